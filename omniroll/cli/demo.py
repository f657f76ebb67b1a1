"""`omniroll demo`: build the tiny model (cached) and generate for a few bundled prompts (what `make demo` runs)."""

from __future__ import annotations

import os
from pathlib import Path

HELP = "build the tiny model (cached) and generate for a few bundled prompts"

DEMO_PROMPTS = [
    "a photo of a red car in front of a house",
    "a blue bird sitting on a tree",
    "a cat and a dog playing in the park",
]


def add_arguments(parser) -> None:
    parser.add_argument("--out", default="out/demo", help="output directory")


def run(args) -> int:
    from omniroll.cli import build_parser
    from omniroll.cli.generate import run_generate

    gen_args = build_parser().parse_args(["generate", "--out", args.out, "--n", "4", "--steps", "8"]
                                         + sum([["--prompt", p] for p in DEMO_PROMPTS], []))
    metrics = run_generate(gen_args)
    out = Path(args.out).resolve()
    print(f"\nomniroll demo: {metrics['num_images']} images in {metrics['seconds']:.1f} s "
          f"({metrics['images_per_second']:.1f} img/s) on the embedded tiny model")
    for name in sorted(os.listdir(out)):
        print(f"  {out / name}")
    return 0
