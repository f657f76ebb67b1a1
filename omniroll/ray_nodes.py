"""Ray's nodes and the actors on them, one home for every layer (a leaf module: it imports no omniroll package):
the node this process runs on (`this_node`, `this_node_id`), the nodes Ray actors landed on (`actor_node_ids`), the
best-effort teardown of actors (`kill_actors`), and the actors Ray brings back when their node leaves (`RESTARTED`,
`actor_fault`, `ActorHealth`). Outside Ray every answer is None (an in-process engine has no node).

Restarted actors: the reward and agent-loop workers hold no state a restart could lose (a restart runs their
constructor again, with the same arguments), so Ray restarts them (`RESTARTED`) on a node that has room for them when
their process or node is lost. A call in flight then fails with `ActorUnavailableError`; its caller marks the actor
(`ActorHealth.lost`), sends the work to another actor of the set, or waits for this one to answer again, for at
most `restart_timeout_s` (a restart that finds no node with the actor's resources would otherwise wait forever).
"""

from __future__ import annotations

import asyncio
from typing import Any, Optional

#: Ray actor options of a stateless worker: restarted without limit; a call in flight when it is lost is not re-sent
#: by Ray (its caller decides where it goes: `ActorHealth`)
RESTARTED = {"max_restarts": -1, "max_task_retries": 0}


def this_node() -> tuple[Optional[str], Optional[str]]:
    """(node id, node IP address) of this process in Ray; (None, None) outside Ray."""
    try:
        import ray

        if not ray.is_initialized():
            return None, None
        return ray.get_runtime_context().get_node_id(), ray.util.get_node_ip_address()
    except Exception:  # noqa: BLE001 - not a Ray worker
        return None, None


def this_node_id() -> Optional[str]:
    """The Ray node id of this process (None outside Ray)."""
    return this_node()[0]


def actor_node_ids(targets: list, timeout_s: float) -> list[Optional[str]]:
    """Each target's Ray node id from its ``node_id()`` actor method, asked of all at once (None: in-process, no such
    method, gone or unreachable)."""
    refs = {k: t.node_id.remote() for k, t in enumerate(targets) if hasattr(getattr(t, "node_id", None), "remote")}
    out: list[Optional[str]] = [None] * len(targets)
    if refs:
        import ray

        for k, ref in refs.items():
            try:
                out[k] = ray.get(ref, timeout=min(timeout_s, 60.0))
            except Exception:  # noqa: BLE001 - unknown node
                out[k] = None
    return out


def kill_actors(handles: list[Any]) -> None:
    """Best-effort teardown of Ray actors (replicas, reward workers, agent-loop workers): each is killed without
    restart; one that is already gone is skipped."""
    import ray

    for h in handles:
        try:
            ray.kill(h, no_restart=True)
        except Exception:  # noqa: BLE001 - already gone
            pass


def actor_fault(error: BaseException) -> Optional[str]:
    """Whose fault a failed actor call is: "restarting" (the actor is unreachable for now: Ray is restarting it, its
    node left), "dead" (gone for good: killed, or out of restarts), or None (the call's own error: not the actor's)."""
    try:
        from ray.exceptions import ActorUnavailableError, RayActorError
    except ImportError:  # no Ray: in-process workers only
        return None
    if isinstance(error, ActorUnavailableError):  # a subclass of RayActorError: asked first
        return "restarting"
    if isinstance(error, RayActorError):
        return "dead"
    return None


class ActorHealth:
    """Which actors of a set can take work now. An actor whose call failed with `actor_fault` "restarting" is probed
    (Ray's built-in `__ray_ready__`) until it answers (then it takes work again) or `restart_timeout_s` passes (then
    it is dead, with the reason); "dead" is for good. Use it from one event loop (the probes are tasks on it)."""

    def __init__(self, handles: list, restart_timeout_s: float = 300.0):
        self.handles = list(handles)
        self.restart_timeout_s = float(restart_timeout_s)
        self.dead: dict[int, str] = {}  # index -> why it is gone for good
        self._probes: dict[int, asyncio.Task] = {}  # index -> its probe, while Ray restarts it

    def usable(self) -> list[int]:
        """The actors that take work now, in order."""
        return [i for i in range(len(self.handles)) if i not in self.dead and i not in self._probes]

    def restarting(self) -> list[int]:
        return sorted(self._probes)

    def lost(self, index: int, error: BaseException) -> str:
        """Record that a call to actor `index` failed with `error` (an `actor_fault`); returns the reason, one line."""
        lines = [ln for ln in str(error).strip().splitlines() if ln.strip()]
        reason = f"{type(error).__name__}: {lines[0][:200] if lines else repr(error)}"
        if actor_fault(error) == "restarting":
            if index not in self.dead and index not in self._probes:
                self._probes[index] = asyncio.ensure_future(self._probe(index, reason))
        else:
            self._forget(index)
            self.dead.setdefault(index, reason)
        return reason

    async def wait_usable(self) -> list[int]:
        """The usable actors; when there are none, wait for a restarting one to answer (or for every probe to end).
        An empty list: every actor is gone for good (`dead` says why)."""
        while not self.usable() and self._probes:
            await asyncio.wait(list(self._probes.values()), return_when=asyncio.FIRST_COMPLETED)
        return self.usable()

    def close(self) -> None:
        for index in list(self._probes):
            self._forget(index)

    async def _probe(self, index: int, reason: str) -> None:
        """Ask the actor whether it is ready until it answers (it is back), is dead for good, or the time is up."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.restart_timeout_s
        try:
            while True:
                try:
                    await asyncio.wait_for(_ready(self.handles[index]), max(deadline - loop.time(), 0.0))
                    return
                except asyncio.TimeoutError:
                    why = "it did not come back"
                except Exception as e:  # noqa: BLE001 - classified: unavailable is asked again, the rest is the end
                    if actor_fault(e) == "restarting" and loop.time() < deadline:
                        await asyncio.sleep(min(0.5, max(deadline - loop.time(), 0.0)))
                        continue
                    why = f"{type(e).__name__} while it restarted"
                self.dead.setdefault(index, f"{reason}; {why} within restart_timeout_s={self.restart_timeout_s:g}s "
                                            f"(a restart needs a node with room for the actor's resources)")
                return
        finally:
            if self._probes.get(index) is asyncio.current_task():
                del self._probes[index]

    def _forget(self, index: int) -> None:
        probe = self._probes.pop(index, None)
        if probe is not None:
            probe.cancel()


async def _ready(handle: Any) -> Any:
    return await handle.__ray_ready__.remote()
