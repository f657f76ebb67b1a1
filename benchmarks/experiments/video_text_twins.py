"""Experiment: can the shapes-video model's text encoder tell a prompt from its twin, as the transformer reads it?

Wan's cross-attention puts no position on the text: the transformer reads a prompt's embeddings as a **set** of token
vectors. Twins of the order and change categories ("a circle appears, then a square" / "a square appears, then a
circle"; "from red to green" / "from green to red") and two-motion prompts with their directions swapped between the
objects ("a square moving down and a triangle moving left" / "... moving left ... moving down") hold the same words, so
only what the encoder mixes in from a word's neighbours tells them apart. This measures, per category, the distance
between a prompt's token set and its twin's (Chamfer: each token to its nearest in the other set, both ways, averaged)
against the distance to another prompt of the same category; a ratio near 0 is a pair the transformer can hardly tell
apart. Direction twins differ in a word ("left" / "right"), the control.

    .venv/bin/python benchmarks/experiments/video_text_twins.py [--model DIR]   # default: the shipped shapes-video
    .venv/bin/python benchmarks/experiments/video_text_twins.py --random-text 6,64   # a random encoder of that shape
    .venv/bin/python benchmarks/experiments/video_text_twins.py --random-text 2,32 --absolute-positions  # a BERT

Ends with one JSON line (per category: the twin and the other prompt's mean set distance, their ratio).
"""

from __future__ import annotations

import argparse
import json
import random
from types import SimpleNamespace

import torch

from omniroll.models.shapes_video.text import TEXT_LENGTH, VideoTextRecipe, build_text
from omniroll.tasks.moving_shapes.grammar import PromptError, all_prompts, parse_prompt, twin_prompt


def swapped_directions(prompt: str) -> str | None:
    """A two-motion prompt with its two directions exchanged (the same words), or None if that is not a prompt."""
    first, sep, second = prompt.partition(" and ")
    a, b = first.rsplit(" ", 1), second.rsplit(" ", 1)
    if not sep or a[1] == b[1]:
        return None
    out = f"{a[0]} {b[1]} and {b[0]} {a[1]}"
    try:
        parse_prompt(out)
    except PromptError:
        return None
    return out


def token_sets(pipe, prompts: list[str]) -> list[torch.Tensor]:
    """Each prompt's text-encoder output vectors at its real tokens (the padding, zero in the pipeline's embeds,
    dropped)."""
    tok = pipe.tokenizer(prompts, padding="max_length", max_length=TEXT_LENGTH, truncation=True,
                         return_attention_mask=True, return_tensors="pt")
    with torch.no_grad():
        h = pipe.text_encoder(tok.input_ids, tok.attention_mask).last_hidden_state
    return [h[i, : int(tok.attention_mask[i].sum())] for i in range(len(prompts))]


def random_bert(vocab: int, layers: int, width: int):
    """A random BERT encoder (transformers' `BertModel`, seeded) of the UMT5 recipe's shape: 4 heads, ffn 2x wide."""
    from transformers import BertConfig, BertModel

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        conf = BertConfig(vocab_size=vocab, hidden_size=width, num_hidden_layers=layers, num_attention_heads=4,
                          intermediate_size=2 * width, max_position_embeddings=TEXT_LENGTH)
        return BertModel(conf, add_pooling_layer=False).eval()


def chamfer(a: torch.Tensor, b: torch.Tensor) -> float:
    d = torch.cdist(a, b)
    return float((d.min(1).values.mean() + d.min(0).values.mean()) / 2)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="a shapes-video checkpoint directory (default: the shipped one)")
    ap.add_argument("--random-text", default=None, metavar="LAYERS,WIDTH",
                    help="measure a random UMT5 of the recipe's kind with this many layers and this width instead")
    ap.add_argument("--absolute-positions", action="store_true",
                    help="with --random-text: a random BERT encoder (absolute position embeddings added to every "
                         "token) of that shape instead of a UMT5 (relative position buckets only)")
    ap.add_argument("--pairs", type=int, default=60, help="prompts drawn per category")
    args = ap.parse_args()
    if args.absolute_positions and not args.random_text:
        raise SystemExit("--absolute-positions measures a random encoder: give --random-text LAYERS,WIDTH too")
    from diffusers import WanPipeline

    from omniroll.models.shapes_video import checkpoint_dir

    torch.set_num_threads(1)
    if args.random_text:
        try:
            layers, width = (int(x) for x in args.random_text.split(","))
        except ValueError:
            raise SystemExit(f"--random-text: LAYERS,WIDTH as two ints, got {args.random_text!r}") from None
        if layers < 1 or width < 4 or width % 4:
            raise SystemExit(f"--random-text: LAYERS >= 1 and WIDTH a multiple of 4 (4 heads), got {args.random_text}")
        text = build_text(VideoTextRecipe(num_layers=layers, d_model=width, d_ff=2 * width, encoder="umt5"))
        if args.absolute_positions:
            text["text_encoder"] = random_bert(len(text["tokenizer"]), layers, width)
        pipe = SimpleNamespace(**text)
    else:
        pipe = WanPipeline.from_pretrained(args.model or checkpoint_dir())
    by_tag: dict[str, list[str]] = {}
    for p in all_prompts():
        by_tag.setdefault(parse_prompt(p).tag, []).append(p)
    rng, result = random.Random(0), {}
    print(f"{'category':12s} {'pair':22s} {'to the pair':>11s} {'to another':>10s} {'ratio':>6s}  example")
    for tag, prompts in by_tag.items():
        pairs = [(tag, twin_prompt)] + ([("two_motions_swapped", swapped_directions)] if tag == "two_motions" else [])
        for name, pair_of in pairs:
            chosen = [(p, pair_of(p)) for p in rng.sample(prompts, min(args.pairs, len(prompts)))]
            chosen = [(p, q) for p, q in chosen if q is not None]
            others = [rng.choice([o for o in prompts if o not in (p, q)]) for p, q in chosen]
            a, b, c = (token_sets(pipe, ps) for ps in ([p for p, _ in chosen], [q for _, q in chosen], others))
            to_pair = sum(map(chamfer, a, b)) / len(a)
            to_other = sum(map(chamfer, a, c)) / len(a)
            result[name] = {"to_pair": round(to_pair, 4), "to_other": round(to_other, 4),
                            "ratio": round(to_pair / to_other, 3), "pairs": len(a)}
            kind = "its twin" if name == tag else "directions swapped"
            print(f"{tag:12s} {kind:22s} {to_pair:11.3f} {to_other:10.3f} {to_pair / to_other:6.2f}  "
                  f"{chosen[0][0]!r} / {chosen[0][1]!r}")
    kind = "BERT" if args.absolute_positions else "UMT5"
    name = f"random {kind} {args.random_text}" if args.random_text else args.model or "shapes-video"
    print(json.dumps({"model": name, "categories": result}))


if __name__ == "__main__":
    main()
