"""`omniroll demo`: build the tiny model (cached) and generate for a few bundled prompts (what `make demo` runs)."""

from __future__ import annotations

HELP = "build the tiny model (cached) and generate for a few bundled prompts"

DEMO_PROMPTS = [
    "a photo of a red car in front of a house",
    "a blue bird sitting on a tree",
    "a cat and a dog playing in the park",
]

#: the demo's settings: small enough for a laptop CPU in seconds
DEMO_FLAGS = ["--model", "tiny", "--n", "4", "--steps", "8", "--height", "128", "--width", "128",
              "--max-sequence-length", "32", "--guidance", "4.5", "--noise-level", "0.7", "--seed", "0"]


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
          f"({metrics['images_per_second']:.1f} img/s) on the embedded tiny model (random weights: its pictures are "
          f"smooth noise-like textures, not objects; the point is the trajectories and log-probs)")
    print_files(metrics)
    return 0
