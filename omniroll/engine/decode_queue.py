"""Finished samples waiting for their VAE decode, released in blocks.

The VAE decodes `block` samples of one latent shape per call (zero-padded in batch-invariant mode, see
`ModelRunner.decode`), so a sample's pixels never depend on what finished with it. A partial block waits for more
finished samples of its shape while requests are running, for at most `block` steps; `flush` releases it now.
"""

from __future__ import annotations

from omniroll.engine.request import RequestState


class DecodeQueue:
    def __init__(self, block: int):
        self.block = block
        self._waiting: list[tuple[RequestState, int]] = []  # (finished sample, the step it finished at)

    def __bool__(self) -> bool:
        return bool(self._waiting)

    def add(self, states: list[RequestState], step: int) -> None:
        self._waiting += [(s, step) for s in states]

    def take_blocks(self, step: int, running: bool, flush: bool = False) -> list[list[RequestState]]:
        """The blocks to decode now, each of one latent shape; the rest keep waiting."""
        by_shape: dict[tuple, list[tuple[RequestState, int]]] = {}
        for entry in self._waiting:
            by_shape.setdefault(tuple(entry[0].latents.shape), []).append(entry)
        blocks, waiting = [], []
        for entries in by_shape.values():
            while entries:
                if len(entries) < self.block and not flush and running and step - entries[0][1] < self.block:
                    waiting += entries
                    break
                blocks.append([s for s, _ in entries[:self.block]])
                entries = entries[self.block:]
        self._waiting = waiting
        return blocks

    def drain(self) -> list[RequestState]:
        """Every waiting sample (the engine is stopping); the queue is left empty."""
        states = [s for s, _ in self._waiting]
        self._waiting = []
        return states
