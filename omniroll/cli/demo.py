"""`omniroll demo`: generate with the shipped shapes model for a few prompts of the shapes world, with SDE log-probs
(what `make demo` runs before it trains)."""

from __future__ import annotations

HELP = "generate with the shipped shapes model (SDE log-probs) for a few prompts of the shapes world"

DEMO_PROMPTS = [
    "a red circle",
    "three squares",
    "a circle left of a square",
    "a blue triangle and a yellow square",
]

#: the demo's settings: the shapes model's own defaults (64 x 64, 10 steps, CFG 4.5), a few seconds on a laptop CPU
DEMO_FLAGS = ["--model", "shapes", "--n", "4", "--noise-level", "0.7", "--seed", "0"]


def add_arguments(parser) -> None:
    parser.add_argument("--out", default="out/demo", help="output directory")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")


def run(args) -> int:
    from omniroll.cli import build_parser
    from omniroll.cli.generate import print_files, run_generate

    argv = ["generate", "--out", args.out, *DEMO_FLAGS, *sum([["--prompt", p] for p in DEMO_PROMPTS], [])]
    gen_args = build_parser().parse_args(argv + (["--quiet"] if args.quiet else []))
    metrics = run_generate(gen_args)
    print(f"\nomniroll demo: {metrics['num_images']} images in {metrics['seconds']:.1f} s "
          f"({metrics['images_per_second']:.1f} img/s) with the shapes model (`--model shapes`: a small SD3 trained "
          f"on the shapes world; SDE sampling, so some pictures miss their prompt: RL's job)")
    print_files(metrics)
    return 0
