"""How a request leaves the engine, exactly once: delivered (its output built, its pixels decoded in blocks of one
latent shape by the `DecodeQueue`), aborted (an output with stop_reason "aborted") or failed (its caller gets the
error).

`Completion` is the engine's one place for it. It takes the requests it ends out of the scheduler and the inbox
itself (an abort by id, every request, the running ones), or is handed the finished ones by the loop (`deliver`). It
runs on the engine thread between two steps, or once the loop has stopped (`fail_pending`). It counts the samples
served.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

from omniroll.engine.decode_queue import DecodeQueue
from omniroll.engine.errors import EngineError, EngineShutdownError
from omniroll.engine.inbox import Inbox
from omniroll.engine.output import DiffusionOutput
from omniroll.engine.output_assembly import aborted_output, build_output
from omniroll.engine.request import RequestState
from omniroll.engine.runner import ModelRunner
from omniroll.engine.scheduler import Scheduler

#: what a request ends with: its output, or the error its caller gets
Outcome = Callable[[RequestState], "DiffusionOutput | BaseException"]


def failed(error: BaseException) -> Outcome:
    """Each request's own EngineError for a failure `error` caused (a batch's forward, a decode, a loop bug)."""
    return lambda s: EngineError(f"request {s.request_id} failed: {error!r}")


class Completion:
    def __init__(self, runner: ModelRunner, scheduler: Scheduler, inbox: Inbox, decode_batch_size: int,
                 weight_version: Callable[[], int]):
        self.runner = runner
        self.scheduler = scheduler
        self.inbox = inbox
        self.decode_queue = DecodeQueue(decode_batch_size)  # finished, waiting for a full decode block
        self.weight_version = weight_version  # the engine's version now (an aborted output reports it)
        self.served = 0

    def settle(self, states: list[RequestState], outcome: Outcome) -> list[str]:
        """Complete these requests (already out of the scheduler and the inbox), each with `outcome(state)`: its
        output or its error. Returns their ids."""
        for s in states:
            result = outcome(s)
            s.on_done(None, result) if isinstance(result, BaseException) else s.on_done(result, None)
        return [s.request_id for s in states]

    # ------------------------------------------------------------------ aborted
    def abort(self, states: list[RequestState]) -> list[str]:
        """Complete these requests (already out of the scheduler and the inbox) as aborted; returns their ids."""
        return self.settle(states, lambda s: aborted_output(s, self.weight_version()))

    def abort_request(self, request_id: str) -> bool:
        """Abort a waiting or running request; returns whether it existed."""
        state = self.inbox.remove(request_id) or self.scheduler.remove(request_id)
        if state is None:
            return False
        self.abort([state])
        return True

    def abort_all(self) -> list[str]:
        """Abort every request, arrived, waiting or running; returns their ids."""
        return self.abort(self.inbox.take_requests() + self.scheduler.drain_all())

    def abort_running(self) -> list[str]:
        """Abort every running request; returns their ids."""
        states = list(self.scheduler.running)
        self.scheduler.finish(states)
        return self.abort(states)

    # ------------------------------------------------------------------ failed
    def fail(self, states: list[RequestState], error: BaseException) -> None:
        """Fail these running requests with `error`, and with them the requests waiting for a shared prefix one of
        them was computing (a tree's subtree), each told which request's prefix failed."""
        dependents = self.scheduler.fail(states)
        self.settle(states, failed(error))
        cause = {id(s): leader for s, leader in dependents}
        self.settle([s for s, _ in dependents], lambda s: EngineError(
            f"request {s.request_id} failed: the shared prefix it waited for (computed by request "
            f"{cause[id(s)].request_id}) failed: {error!r}"))

    def fail_waiting(self, error: BaseException) -> None:
        """Fail every queued and running request with (a copy per request of) `error`."""
        self.settle(self.scheduler.drain_all() + self.inbox.take_requests(),
                    lambda s: type(error)(f"request {s.request_id}: {error}"))

    def fail_pending(self) -> None:
        """The loop has stopped: fail every queued control call and every request, undecoded ones included, with
        EngineShutdownError."""
        arrivals = self.inbox.drain()
        closed = self.inbox.closed
        undecoded = self.decode_queue.drain()
        self.settle(self.scheduler.drain_all() + arrivals + undecoded,
                    lambda s: EngineShutdownError(f"request {s.request_id}: the engine is {closed}"))

    # ------------------------------------------------------------------ delivered
    def deliver(self, states: list[RequestState], step: int, flush: bool = False) -> list[DiffusionOutput]:
        """Deliver finished requests (out of the scheduler): latents at once, pixels in the decode blocks the
        `DecodeQueue` releases at `step` (the engine's step count; `flush`: every waiting sample now). A failed
        decode fails its block's requests only."""
        outputs = [self._output(s, None) for s in states if s.params.output_type == "latent"]
        self.decode_queue.add([s for s in states if s.params.output_type != "latent"], step)
        for block in self.decode_queue.take_blocks(step, bool(self.scheduler.running), flush):
            outputs += self._decode_block(block)
        return [o for o in outputs if o is not None]

    def _decode_block(self, states: list[RequestState]) -> list[Optional[DiffusionOutput]]:
        try:
            decoded = self.runner.decode(torch.stack([s.latents for s in states]))
        except Exception as e:  # noqa: BLE001 - fails this block's requests, not the engine
            self.settle(states, failed(e))
            return []
        return [self._output(s, decoded[i]) for i, s in enumerate(states)]

    def _output(self, s: RequestState, pixels: Optional[torch.Tensor]) -> Optional[DiffusionOutput]:
        try:
            out = build_output(s, pixels, self.runner.execution_info())
        except Exception as e:  # noqa: BLE001 - e.g. NaN pixels: this request fails loudly, the others go on
            s.on_done(None, e)
            return None
        self.served += 1
        s.on_done(out, None)
        return out
