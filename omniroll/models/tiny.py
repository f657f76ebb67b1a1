"""Deterministic random SD3 checkpoints, built offline (tests, demos, benchmarks).

`build_tiny_sd3(path, seed)` writes a directory laid out like a real diffusers SD3 repo (so that
`StableDiffusion3Pipeline.from_pretrained(path)` loads it): random fp32 weights (safetensors) drawn from `seed`, and
tokenizers trained in memory on a built-in word list. Same seed and preset give byte-identical weight files.
"""

from __future__ import annotations

import copy
import fcntl
import functools
import json
import math
import os
import shutil

import torch

MARKER_FILE = "omniroll_tiny.json"
LOCK_FILE = ".omniroll_tiny.lock"
_MARKER_VERSION = 1
_COMPONENTS = (
    "transformer", "vae", "scheduler", "text_encoder", "text_encoder_2", "text_encoder_3",
    "tokenizer", "tokenizer_2", "tokenizer_3",
)

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


def _word_stream() -> list[str]:
    """The training corpus: each word repeated with a Zipf-like count (deterministic)."""
    unique = list(dict.fromkeys(WORDS))
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


@functools.lru_cache(maxsize=1)
def _train_bpe(words: tuple[str, ...]) -> tuple[tuple[str, ...], tuple[tuple[str, str], ...]]:
    """Deterministic byte-level BPE training (CLIP layout: 256 bytes, 256 bytes + `</w>`, merges, specials).

    Pairs are merged by frequency, ties broken lexicographically, until every word is a single token. (The
    `tokenizers` BpeTrainer breaks ties by hash order, which would change token ids and hence weights run to run.)
    """
    alphabet = _bytes_to_unicode()
    freq: dict[tuple[str, ...], int] = {}
    for w in words:
        syms = tuple(w[:-1]) + (w[-1] + "</w>",)
        freq[syms] = freq.get(syms, 0) + 1
    vocab_list = alphabet + [a + "</w>" for a in alphabet]
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
    vocab_list += ["<|startoftext|>", "<|endoftext|>"]
    return tuple(vocab_list), tuple(merges)


#: the tiny CLIP tokenizers' model_max_length: prompt ids are padded to it (what `prompt_length` must hold)
CLIP_MAX_LENGTH = 77


def _train_clip_tokenizer():
    """CLIP byte-level BPE (normalizer, pre-tokenizer and `</w>` suffix come with `CLIPTokenizer`)."""
    from transformers import CLIPTokenizer

    tokens, merges = _train_bpe(tuple(_word_stream()))
    vocab = {t: i for i, t in enumerate(tokens)}
    eos = "<|endoftext|>"
    return CLIPTokenizer(
        vocab=vocab, merges=list(merges), bos_token="<|startoftext|>", eos_token=eos, unk_token=eos, pad_token=eos,
        model_max_length=CLIP_MAX_LENGTH,
    )


def _build_t5_tokenizer():
    """A Unigram (SentencePiece-style) T5 tokenizer: `<pad>`=0, `</s>`=1, `<unk>`=2, whole words and characters."""
    from transformers import T5TokenizerFast

    counts: dict[str, int] = {}
    for w in _word_stream():
        counts["\u2581" + w] = counts.get("\u2581" + w, 0) + 1
    total = sum(counts.values())
    chars = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789.,!?;:'\"-()/&+*#%=_"
    vocab = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("\u2581", -3.0)]
    vocab += [(piece, math.log(c / total)) for piece, c in counts.items()]
    vocab += [(ch, -20.0) for ch in chars] + [("\u2581" + ch, -19.0) for ch in chars]
    return T5TokenizerFast(vocab=vocab, extra_ids=0, model_max_length=512)


# --------------------------------------------------------------------------- configs
PRESETS: dict[str, dict] = {
    "tiny": {
        "transformer": dict(sample_size=8, patch_size=2, in_channels=16, out_channels=16, num_layers=2,
                            attention_head_dim=8, num_attention_heads=4, pos_embed_max_size=64),
        "vae": dict(block_out_channels=(8, 16, 32, 32), layers_per_block=1, norm_num_groups=4),
        "clip": dict(hidden_size=16, intermediate_size=32, projection_dim=32, num_hidden_layers=2,
                     num_attention_heads=2),
        "t5": dict(d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4, relative_attention_num_buckets=8),
    },
    "bench": {
        "transformer": dict(sample_size=32, patch_size=2, in_channels=16, out_channels=16, num_layers=4,
                            attention_head_dim=64, num_attention_heads=4, pos_embed_max_size=96),
        "vae": dict(block_out_channels=(32, 64, 64, 64), layers_per_block=1, norm_num_groups=32),
        "clip": dict(hidden_size=64, intermediate_size=128, projection_dim=64, num_hidden_layers=2,
                     num_attention_heads=4),
        "t5": dict(d_model=256, d_kv=64, d_ff=512, num_layers=2, num_heads=4, relative_attention_num_buckets=32),
    },
}
_GROUPS = ("transformer", "vae", "clip", "t5")
_DERIVED = ("caption_projection_dim", "pooled_projection_dim", "joint_attention_dim")


def resolve_config(preset: str = "tiny", **overrides) -> dict:
    """The preset's component configs with `overrides` applied.

    An override named after a group (`transformer`, `vae`, `clip`, `t5`) must be a dict merged into that group; any
    other key is a transformer field (e.g. `num_layers=6`). The transformer's caption_projection_dim,
    pooled_projection_dim and joint_attention_dim are derived from the other components and cannot be overridden.
    """
    if preset not in PRESETS:
        raise ValueError(f"preset must be one of {sorted(PRESETS)}, got {preset!r}")
    cfg = copy.deepcopy(PRESETS[preset])
    for key, value in overrides.items():
        if key in _GROUPS:
            if not isinstance(value, dict):
                raise ValueError(f"override {key!r} must be a dict of {key} config fields, got {type(value).__name__}")
            cfg[key].update(value)
        elif key in _DERIVED:
            raise ValueError(f"override {key!r} is derived from the text encoders / heads and cannot be set")
        else:
            cfg["transformer"][key] = value
    import inspect

    from diffusers import SD3Transformer2DModel

    params = set(inspect.signature(SD3Transformer2DModel.__init__).parameters) - {"self", *_DERIVED}
    bad = sorted(set(cfg["transformer"]) - params)
    if bad:
        raise ValueError(f"unknown SD3Transformer2DModel override(s) {bad}; allowed: {sorted(params)}")
    tr = cfg["transformer"]
    tr["caption_projection_dim"] = tr["num_attention_heads"] * tr["attention_head_dim"]
    tr["pooled_projection_dim"] = 2 * cfg["clip"]["projection_dim"]
    tr["joint_attention_dim"] = cfg["t5"]["d_model"]
    return cfg


# --------------------------------------------------------------------------- builder
def _seeded(seed: int, index: int, ctor):
    """Construct a module under a fixed seed without disturbing the caller's global RNG."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed * 1009 + index)
        return ctor().eval()


def _marker(seed: int, preset: str, overrides: dict) -> dict:
    return {"version": _MARKER_VERSION, "seed": int(seed), "preset": preset,
            "overrides": json.loads(json.dumps(overrides, sort_keys=True, default=list))}


def _is_complete(path: str, marker: dict) -> bool:
    try:
        with open(os.path.join(path, MARKER_FILE)) as f:
            found = json.load(f)
    except (OSError, ValueError):
        return False
    return found == marker and all(os.path.isdir(os.path.join(path, c)) for c in _COMPONENTS) \
        and os.path.isfile(os.path.join(path, "model_index.json"))


def build_tiny_sd3(path: str, seed: int = 0, preset: str = "tiny", **overrides) -> str:
    """Write a random SD3 checkpoint to `path` (created if missing) and return `path`.

    Idempotent: if `path` already holds a complete checkpoint built with the same seed / preset / overrides (see the
    `omniroll_tiny.json` marker), it is returned untouched.
    """
    if not isinstance(seed, int) or isinstance(seed, bool) or seed < 0:
        raise ValueError(f"seed must be a non-negative int, got {seed!r}")
    cfg = resolve_config(preset, **overrides)
    marker = _marker(seed, preset, overrides)
    path = os.fspath(path)
    if _is_complete(path, marker):
        return path
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, LOCK_FILE), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # concurrent builders (e.g. Ray workers) wait for the first one
        try:
            if not _is_complete(path, marker):
                _build(path, seed, cfg, marker)
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
    return path


def _build(path: str, seed: int, cfg: dict, marker: dict) -> None:
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel, StableDiffusion3Pipeline
    from transformers import CLIPTextConfig, CLIPTextModelWithProjection, T5Config, T5EncoderModel

    tokenizer = _train_clip_tokenizer()
    tokenizer_2 = _train_clip_tokenizer()
    tokenizer_3 = _build_t5_tokenizer()

    def clip(index: int):
        c = cfg["clip"]
        conf = CLIPTextConfig(
            vocab_size=len(tokenizer), max_position_embeddings=77, hidden_act="gelu",
            bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
            **c,
        )
        return _seeded(seed, index, lambda: CLIPTextModelWithProjection(conf))

    t5_conf = T5Config(
        vocab_size=len(tokenizer_3), feed_forward_proj="gated-gelu", relative_attention_max_distance=128,
        pad_token_id=tokenizer_3.pad_token_id, eos_token_id=tokenizer_3.eos_token_id, decoder_start_token_id=0,
        is_encoder_decoder=False, use_cache=False, **cfg["t5"],
    )
    vae_cfg = dict(cfg["vae"])
    n_blocks = len(vae_cfg["block_out_channels"])
    vae_cfg.setdefault("down_block_types", ("DownEncoderBlock2D",) * n_blocks)
    vae_cfg.setdefault("up_block_types", ("UpDecoderBlock2D",) * n_blocks)
    vae_cfg.setdefault("latent_channels", cfg["transformer"]["in_channels"])
    vae_cfg.setdefault("scaling_factor", 1.5305)
    vae_cfg.setdefault("shift_factor", 0.0609)
    vae_cfg.setdefault("use_quant_conv", False)
    vae_cfg.setdefault("use_post_quant_conv", False)
    vae_cfg.setdefault("sample_size", cfg["transformer"]["sample_size"] * 2 ** (n_blocks - 1))
    vae_cfg["block_out_channels"] = tuple(vae_cfg["block_out_channels"])

    pipe = StableDiffusion3Pipeline(
        transformer=_seeded(seed, 0, lambda: SD3Transformer2DModel(**cfg["transformer"])),
        vae=_seeded(seed, 1, lambda: AutoencoderKL(**vae_cfg)),
        text_encoder=clip(2),
        text_encoder_2=clip(3),
        text_encoder_3=_seeded(seed, 4, lambda: T5EncoderModel(t5_conf)),
        tokenizer=tokenizer,
        tokenizer_2=tokenizer_2,
        tokenizer_3=tokenizer_3,
        scheduler=FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0),
    )
    stale = os.path.join(path, MARKER_FILE)
    if os.path.exists(stale):
        os.remove(stale)
    for comp in _COMPONENTS:  # never mix files of two builds
        shutil.rmtree(os.path.join(path, comp), ignore_errors=True)
    pipe.save_pretrained(path, safe_serialization=True)
    with open(os.path.join(path, MARKER_FILE), "w") as f:
        json.dump(marker, f, indent=2, sort_keys=True)
