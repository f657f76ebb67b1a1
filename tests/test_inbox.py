"""The engine's Inbox: requests and control calls on their way to the loop thread (unique ids, all-or-none adds,
remove, close and drain)."""

import concurrent.futures
import threading
import time

import pytest

from omniroll.engine.errors import EngineShutdownError, RequestError
from omniroll.engine.inbox import Inbox


class _State:  # what the inbox reads of a RequestState: its id
    def __init__(self, request_id):
        self.request_id = request_id


def test_ids_are_unique_in_flight_and_an_add_is_all_or_none():
    inbox = Inbox()
    inbox.add([_State("a"), _State("b")])
    with pytest.raises(RequestError, match="already in flight"):
        inbox.add([_State("c"), _State("a")])
    with pytest.raises(RequestError, match="already in flight"):
        inbox.add([_State("d"), _State("d")])
    assert len(inbox) == 2
    assert inbox.remove("b").request_id == "b" and inbox.remove("b") is None
    states, controls = inbox.take(busy=lambda: False)
    assert [s.request_id for s in states] == ["a"] and controls == []
    with pytest.raises(RequestError):
        inbox.add([_State("b")])  # removed from the queue, but in flight until released
    inbox.release("b")
    inbox.add([_State("b"), _State("c")])  # "c" was refused with "a" above: nothing of that add was kept
    assert [s.request_id for s in inbox.take_requests()] == ["b", "c"]


def test_calls_run_on_the_loop_and_close_fails_what_is_left():
    inbox = Inbox()
    loop = threading.Thread(target=lambda: [Inbox.run(c) for c in inbox.take(busy=lambda: False)[1]])
    loop.start()
    assert inbox.call(lambda: 41 + 1, timeout_s=30, op="answer") == 42
    loop.join()
    with pytest.raises(TimeoutError, match="slow did not start within 0.05s .*: it will never run, nothing changed"):
        inbox.call(lambda: None, timeout_s=0.05, op="slow")  # no loop takes it: it never runs
    inbox = Inbox()
    assert inbox.wait_until(lambda: True, time.monotonic()) and not inbox.wait_until(lambda: False, 0.0)
    idle = concurrent.futures.ThreadPoolExecutor(1).submit(inbox.wait_until, lambda: False, time.monotonic() + 30)
    inbox.add([_State("x")])
    waiting = concurrent.futures.ThreadPoolExecutor(1).submit(inbox.call, lambda: None, 30, "late")
    while not inbox._controls:  # noqa: SLF001 - wait until the call is queued
        time.sleep(0.001)
    inbox.close("shut down")
    assert idle.result(timeout=30)  # a close wakes every waiter
    assert inbox.take(busy=lambda: True) is None
    assert [s.request_id for s in inbox.drain()] == ["x"]
    with pytest.raises(EngineShutdownError, match="the engine is shut down"):
        waiting.result(timeout=30)
    with pytest.raises(EngineShutdownError, match="generate: the engine is shut down"):
        inbox.add([_State("y")])
