"""A bounded LRU of prompt encodings: a prompt is encoded once however many samples of it are running."""

from __future__ import annotations

from collections import OrderedDict

from omniroll.models.base import Conditioning, DiffusionAdapter


class PromptCache:
    def __init__(self, adapter: DiffusionAdapter, capacity: int):
        self.adapter = adapter
        self.capacity = capacity
        self._cache: OrderedDict[tuple[str, int], Conditioning] = OrderedDict()
        self.hits = 0
        self.misses = 0

    def get_many(self, prompts: list[str], max_sequence_length: int) -> list[Conditioning | Exception]:
        """Encodings for `prompts` (duplicates allowed); only the missing unique prompts are encoded, each inside its
        own guard: a prompt that fails to encode gets its exception in its place (never cached) and the others
        are unaffected. The returned tensors are the cache's own: callers must not hand them out (see outputs)."""
        found: dict[str, Conditioning | Exception] = {}
        for p in prompts:
            key = (p, max_sequence_length)
            if key in self._cache:
                self._cache.move_to_end(key)
                found[p] = self._cache[key]
        missing = list(dict.fromkeys(p for p in prompts if p not in found))
        for prompt in missing:
            try:
                cond = self.adapter.encode_prompts([prompt], max_sequence_length)[0]
            except Exception as e:  # noqa: BLE001 - this prompt's requests fail, nobody else's
                found[prompt] = e
                continue
            found[prompt] = cond
            self._put((prompt, max_sequence_length), cond)
        self.misses += len(missing)
        self.hits += len(prompts) - len(missing)
        return [found[p] for p in prompts]

    def _put(self, key, cond: Conditioning) -> None:
        self._cache[key] = cond
        self._cache.move_to_end(key)
        while len(self._cache) > self.capacity:
            self._cache.popitem(last=False)

    def clear(self) -> None:
        self._cache.clear()

    def __len__(self) -> int:
        return len(self._cache)
