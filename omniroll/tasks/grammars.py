"""What every world's grammar shares: the valid prompt nearest a text (`nearest_prompt`), one line per prompt of a
list outside the grammar (`prompt_problems`), the words a grammar uses (`words_of`), and a file of prompts read and
checked (`read_prompt_file`). Each world's `grammar.py`
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


def read_prompt_file(path: str, parse: Callable[[str], object], errors: tuple[type, ...]) -> list[str]:
    """The prompts of a file of one grammar prompt per line (blank lines skipped), each as `parse` returns it (its
    `.prompt`: the canonical form); ValueError naming every line `parse` refuses (with its nearest valid prompt), or
    a file with no prompt."""
    prompts, problems = [], []
    with open(path, encoding="utf-8") as f:
        for i, line in enumerate(f, 1):
            if line.strip():
                try:
                    prompts.append(parse(line.rstrip("\r\n")).prompt)  # an error shows the line as written
                except errors as e:
                    problems.append(f"{path} line {i}: {e}")
    if problems:
        raise ValueError("\n".join(problems))
    if not prompts:
        raise ValueError(f"{path} holds no prompt (one grammar prompt a line)")
    return prompts
