"""A bounded LRU of prompt encodings: a prompt is encoded once however many samples of it are running.

A prompt is text or per-encoder token ids (`{"clip": [...], "t5": [...]}`); each is cached under its own key (the
text, or the ids), with the text length.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Hashable, Union

from omniroll.models.base import Conditioning, DiffusionAdapter

PromptInput = Union[str, dict]


def prompt_key(prompt: PromptInput) -> Hashable:
    """The cache key of a prompt: the text itself, or its token ids per encoder."""
    if isinstance(prompt, str):
        return prompt
    return ("token_ids",) + tuple(sorted((k, tuple(int(i) for i in v)) for k, v in prompt.items()))


class PromptCache:
    def __init__(self, adapter: DiffusionAdapter, capacity: int):
        self.adapter = adapter
        self.capacity = capacity
        self._cache: OrderedDict[tuple[Hashable, int], Conditioning] = OrderedDict()
        self.hits = 0
        self.misses = 0

    def get_many(self, prompts: list[PromptInput], max_sequence_length: int) -> list[Conditioning | Exception]:
        """Encodings for `prompts` (texts or token ids; duplicates allowed); only the missing unique ones are
        encoded, each inside its own guard: a prompt that fails to encode gets its exception in its place (never
        cached) and the others are unaffected. The returned tensors are the cache's own: callers must not hand them
        out (see outputs)."""
        keys = [prompt_key(p) for p in prompts]
        found: dict[Hashable, Conditioning | Exception] = {}
        for k in keys:
            if (k, max_sequence_length) in self._cache:
                self._cache.move_to_end((k, max_sequence_length))
                found[k] = self._cache[(k, max_sequence_length)]
        missing = {k: p for k, p in zip(keys, prompts) if k not in found}
        for k, prompt in missing.items():
            try:
                if isinstance(prompt, str):
                    cond = self.adapter.encode_prompts([prompt], max_sequence_length)[0]
                else:
                    cond = self.adapter.encode_token_ids([prompt], max_sequence_length)[0]
            except Exception as e:  # noqa: BLE001 - this prompt's requests fail, nobody else's
                found[k] = e
                continue
            found[k] = cond
            self._put((k, max_sequence_length), cond)
        self.misses += len(missing)
        self.hits += len(prompts) - len(missing)
        return [found[k] for k in keys]

    def _put(self, key, cond: Conditioning) -> None:
        self._cache[key] = cond
        self._cache.move_to_end(key)
        while len(self._cache) > self.capacity:
            self._cache.popitem(last=False)

    def clear(self) -> None:
        self._cache.clear()

    def __len__(self) -> int:
        return len(self._cache)
