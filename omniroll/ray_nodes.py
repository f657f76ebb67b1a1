"""Ray's placement facts and teardown, one home for every layer (a leaf module: it imports no omniroll package):
the node this process runs on (`this_node`, `this_node_id`), the nodes Ray actors landed on (`actor_node_ids`), and the
best-effort teardown of actors (`kill_actors`). Outside Ray every answer is None (an in-process engine has no node).
"""

from __future__ import annotations

from typing import Any, Optional


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
