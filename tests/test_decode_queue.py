"""DecodeQueue: finished samples leave in blocks of one latent shape; a partial block waits at most `block` steps."""

from types import SimpleNamespace

import torch

from omniroll.engine.decode_queue import DecodeQueue


def sample(name, h=4):
    return SimpleNamespace(name=name, latents=torch.zeros(16, h, 4))


def names(blocks):
    return [[s.name for s in b] for b in blocks]


def test_full_blocks_leave_at_once_partial_ones_wait_while_requests_run():
    q = DecodeQueue(block=2)
    q.add([sample("a"), sample("b"), sample("c"), sample("x", h=6)], step=5)
    assert names(q.take_blocks(step=5, running=True)) == [["a", "b"]]  # c and x wait for block mates
    q.add([sample("d")], step=6)
    assert names(q.take_blocks(step=6, running=True)) == [["c", "d"]]  # never mixed with x's shape
    assert q and names(q.take_blocks(step=6, running=True)) == []
    assert names(q.take_blocks(step=7, running=True)) == [["x"]]  # waited `block` steps
    assert not q


def test_partial_blocks_leave_when_nothing_runs_or_on_flush_and_drain_empties():
    q = DecodeQueue(block=4)
    q.add([sample("a")], step=0)
    assert names(q.take_blocks(step=0, running=False)) == [["a"]]
    q.add([sample("b"), sample("c", h=6)], step=1)
    assert names(q.take_blocks(step=1, running=True, flush=True)) == [["b"], ["c"]]
    q.add([sample("d")], step=2)
    assert [s.name for s in q.drain()] == ["d"] and not q
