"""What every world's grammar shares: the valid prompt nearest a text (`nearest_prompt`), one line per prompt of a
list outside the grammar (`prompt_problems`), and the words a grammar uses (`words_of`). Each world's `grammar.py`
binds them to its own prompts, parser and normalisation."""

from __future__ import annotations

import difflib
import re
from typing import Callable, Iterable

_WORD = re.compile(r"[a-z]+")


def nearest_prompt(text: str, prompts: Iterable[str], normalise: Callable[[str], str]) -> str:
    """The prompt of `prompts` closest to `text`, both normalised: by difflib's similarity of their words, then of
    their characters."""
    words = normalise(text).split()
    joined = " ".join(words)

    def score(p: str) -> tuple[float, float]:
        q = normalise(p)
        return (difflib.SequenceMatcher(None, words, q.split()).ratio(),
                difflib.SequenceMatcher(None, joined, q).ratio())

    return max(prompts, key=score)


def prompt_problems(prompts, parse: Callable[[str], object], errors: tuple[type, ...]) -> list[str]:
    """One line per prompt that `parse` refuses with one of `errors` (its message names the nearest valid form), with
    its position in the list."""
    out = []
    for i, p in enumerate(prompts):
        try:
            parse(p)
        except errors as e:
            out.append(f"prompt {i}: {e}")
    return out


def words_of(prompts: Iterable[str]) -> list[str]:
    """Every word of `prompts`, in order of first use (what a model's tokenizers must know as whole tokens)."""
    seen: dict[str, None] = {}
    for p in prompts:
        for w in _WORD.findall(p):
            seen.setdefault(w, None)
    return list(seen)
