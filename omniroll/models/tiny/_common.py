"""What every tiny builder shares: the word list, tokenizers trained in memory, seeded construction, and the
build-once-per-directory protocol (a marker file, a lock for concurrent builders)."""

from __future__ import annotations

import fcntl
import functools
import json
import math
import os
import shutil
from typing import Callable

import torch

MARKER_FILE = "omniroll_tiny.json"
LOCK_FILE = ".omniroll_tiny.lock"
MARKER_VERSION = 1

# A few hundred common English words (image-prompt flavoured). Order matters: earlier words count as more frequent.
WORDS = """
a an the of and with in on at to from by for is are photo picture image painting drawing sketch render
cat dog bird fish horse cow sheep pig rabbit mouse lion tiger bear elephant monkey fox wolf deer duck owl
red blue green yellow orange purple pink brown black white gray grey gold silver colorful bright dark
car bus truck bike bicycle train boat ship plane airplane rocket house home building tower bridge castle
tree flower grass forest mountain hill river lake sea ocean beach sky cloud sun moon star rain snow
city street road park garden field desert island village room kitchen table chair bed window door wall
man woman boy girl child person people baby family friend king queen robot wizard knight astronaut
apple banana orange cake bread pizza cup bottle glass book clock lamp phone computer camera ball hat
one two three four five six seven eight nine ten many some few several small big large tiny huge tall
short long old new young happy sad cute beautiful ugly funny scary strange quiet loud fast slow
hot cold warm wet dry soft hard round square flat sharp smooth rough heavy light empty full clean dirty
sitting standing running walking flying swimming jumping sleeping eating playing reading holding wearing
next behind under above over near inside outside between front top bottom left right middle center
style art oil watercolor digital realistic cartoon anime pixel abstract vintage modern futuristic
night day morning evening sunset sunrise summer winter spring autumn fall light shadow fog mist
wooden metal stone glass plastic paper golden shiny wet furry fluffy striped spotted
it its his her their this that these those there here very too also not no yes or but so
has have had was were be been being do does did can could will would should may might
looking at front view close up wide shot portrait landscape scene background foreground detailed
high quality best masterpiece sharp focus lighting studio natural cinematic dramatic soft
""".split()


def _word_stream(words: tuple[str, ...] | None = None) -> list[str]:
    """The training corpus: each word (default: `WORDS`) repeated with a Zipf-like count (deterministic)."""
    unique = list(dict.fromkeys(WORDS if words is None else words))
    out = []
    for rank, w in enumerate(unique):
        out.extend([w] * max(1, 64 // (1 + rank // 16)))
    return out


# --------------------------------------------------------------------------- tokenizers
def _bytes_to_unicode() -> list[str]:
    """GPT-2 / CLIP byte-level alphabet, in byte order (printable bytes map to themselves)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("\xa1"), ord("\xac") + 1)) + list(range(ord("\xae"), 256))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return [chr(c) for _, c in sorted(zip(bs, cs))]


@functools.lru_cache(maxsize=2)
def _train_bpe(words: tuple[str, ...], style: str = "clip") -> tuple[tuple[str, ...], tuple[tuple[str, str], ...]]:
    """Deterministic byte-level BPE training. "clip" layout: 256 bytes, 256 bytes + `</w>`, merges, specials;
    "gpt2" layout (Qwen2): 256 bytes, merges, words with and without the leading space byte `Ġ`, no specials.

    Pairs are merged by frequency, ties broken lexicographically, until every word is a single token. (The
    `tokenizers` BpeTrainer breaks ties by hash order, which would change token ids and hence weights run to run.)
    """
    alphabet = _bytes_to_unicode()
    freq: dict[tuple[str, ...], int] = {}
    for w in words:
        variants = [tuple(w[:-1]) + (w[-1] + "</w>",)] if style == "clip" else [tuple("\u0120" + w), tuple(w)]
        for syms in variants:
            freq[syms] = freq.get(syms, 0) + 1
    vocab_list = alphabet + [a + "</w>" for a in alphabet] if style == "clip" else list(alphabet)
    merges: list[tuple[str, str]] = []
    while True:
        counts: dict[tuple[str, str], int] = {}
        for syms, c in freq.items():
            for pair in zip(syms, syms[1:]):
                counts[pair] = counts.get(pair, 0) + c
        if not counts:
            break
        best = min(counts, key=lambda p: (-counts[p], p))
        merged, new_freq = best[0] + best[1], {}
        for syms, c in freq.items():
            out, i = [], 0
            while i < len(syms):
                if i + 1 < len(syms) and (syms[i], syms[i + 1]) == best:
                    out.append(merged)
                    i += 2
                else:
                    out.append(syms[i])
                    i += 1
            new_freq[tuple(out)] = new_freq.get(tuple(out), 0) + c
        freq = new_freq
        merges.append(best)
        vocab_list.append(merged)
    if style == "clip":
        vocab_list += ["<|startoftext|>", "<|endoftext|>"]
    return tuple(vocab_list), tuple(merges)


#: the tiny CLIP tokenizers' model_max_length: prompt ids are padded to it (what `prompt_length` must hold)
CLIP_MAX_LENGTH = 77


def train_clip_tokenizer(words: tuple[str, ...] | None = None, max_length: int = CLIP_MAX_LENGTH):
    """CLIP byte-level BPE (normalizer, pre-tokenizer and `</w>` suffix come with `CLIPTokenizer`) on `words`
    (default: `WORDS`; each becomes one token), padding prompts to `max_length` ids."""
    from transformers import CLIPTokenizer

    tokens, merges = _train_bpe(tuple(_word_stream(words)))
    vocab = {t: i for i, t in enumerate(tokens)}
    eos = "<|endoftext|>"
    return CLIPTokenizer(
        vocab=vocab, merges=list(merges), bos_token="<|startoftext|>", eos_token=eos, unk_token=eos, pad_token=eos,
        model_max_length=max_length,
    )


def build_t5_tokenizer(words: tuple[str, ...] | None = None, max_length: int = 512):
    """A Unigram (SentencePiece-style) T5 tokenizer: `<pad>`=0, `</s>`=1, `<unk>`=2, whole words (default: `WORDS`)
    and characters; `max_length` is its `model_max_length` (the longest `max_sequence_length` a model takes)."""
    from transformers import T5TokenizerFast

    counts: dict[str, int] = {}
    for w in _word_stream(words):
        counts["\u2581" + w] = counts.get("\u2581" + w, 0) + 1
    total = sum(counts.values())
    chars = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789.,!?;:'\"-()/&+*#%=_"
    vocab = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("\u2581", -3.0)]
    vocab += [(piece, math.log(c / total)) for piece, c in counts.items()]
    vocab += [(ch, -20.0) for ch in chars] + [("\u2581" + ch, -19.0) for ch in chars]
    return T5TokenizerFast(vocab=vocab, extra_ids=0, model_max_length=max_length)


QWEN_SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>",
                       "<|image_pad|>", "<|video_pad|>")


def train_qwen2_tokenizer():
    """A Qwen2 (GPT-2 style byte-level BPE) tokenizer with Qwen's chat and vision special tokens appended."""
    from transformers import Qwen2Tokenizer

    tokens, merges = _train_bpe(tuple(_word_stream()), "gpt2")
    vocab = {t: i for i, t in enumerate(tokens)}
    tok = Qwen2Tokenizer(vocab=vocab, merges=list(merges), unk_token=None,
                         eos_token="<|endoftext|>", pad_token="<|endoftext|>")
    tok.add_special_tokens({"additional_special_tokens": list(QWEN_SPECIAL_TOKENS[1:])})
    tok.model_max_length = 32768
    return tok


# --------------------------------------------------------------------------- building
def seeded(seed: int, index: int, ctor):
    """Construct a module under a fixed seed without disturbing the caller's global RNG."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed * 1009 + index)
        return ctor().eval()


def check_seed(seed) -> None:
    if not isinstance(seed, int) or isinstance(seed, bool) or seed < 0:
        raise ValueError(f"seed must be a non-negative int, got {seed!r}")


def make_marker(seed: int, preset: str, overrides: dict, family: str = "sd3") -> dict:
    marker = {"version": MARKER_VERSION, "seed": int(seed), "preset": preset,
              "overrides": json.loads(json.dumps(overrides, sort_keys=True, default=list))}
    if family != "sd3":  # SD3 markers predate families; keep them byte-identical
        marker["family"] = family
    return marker


def is_complete(path: str, marker: dict, components: tuple[str, ...]) -> bool:
    try:
        with open(os.path.join(path, MARKER_FILE)) as f:
            found = json.load(f)
    except (OSError, ValueError):
        return False
    return found == marker and all(os.path.isdir(os.path.join(path, c)) for c in components) \
        and os.path.isfile(os.path.join(path, "model_index.json"))


def build_once(path: str, marker: dict, components: tuple[str, ...], make_pipeline: Callable[[], object]) -> str:
    """Save `make_pipeline()` to `path` unless it already holds a complete build with this marker; return `path`.

    Concurrent builders (e.g. Ray workers) wait for the first one on a file lock; a stale build's component
    directories are removed first, so files of two builds never mix.
    """
    path = os.fspath(path)
    if is_complete(path, marker, components):
        return path
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, LOCK_FILE), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            if not is_complete(path, marker, components):
                pipe = make_pipeline()
                stale = os.path.join(path, MARKER_FILE)
                if os.path.exists(stale):
                    os.remove(stale)
                for comp in components:
                    shutil.rmtree(os.path.join(path, comp), ignore_errors=True)
                pipe.save_pretrained(path, safe_serialization=True)
                with open(os.path.join(path, MARKER_FILE), "w") as f:
                    json.dump(marker, f, indent=2, sort_keys=True)
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
    return path
