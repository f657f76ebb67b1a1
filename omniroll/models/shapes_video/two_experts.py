"""A Wan 2.2-style two-expert checkpoint made from a shapes-video checkpoint: the same transformer as both experts
(`transformer` while the timestep is >= `boundary_ratio` x 1000, `transformer_2` below it), so that it draws what the
one-expert model draws, bitwise, until training moves the experts apart.

It is how a two-expert path is checked on a model that draws something checkable: the engine's per-step expert
switch (`expert_indices` in each trajectory), exact ratios across the switch, LoRA or full weights on both experts,
weight sync to both. `omniroll pretrain shapes-video --two-experts --from MODEL --out DIR` writes one to
DIR/checkpoint (seconds: a copy of the files, the transformer twice, and `boundary_ratio` in model_index.json).
"""

from __future__ import annotations

import json
import os
import shutil

#: Wan 2.2 A14B text-to-video's boundary: with the shapes-video model's shift 3 and 10 steps, the first 4 steps run on
#: the high-noise expert and the other 6 on the low-noise one
DEFAULT_BOUNDARY = 0.875
#: files of the source not copied: its sums (written anew) and its evaluation cache entries (another model's)
SKIPPED = ("SHA256SUMS", "evaluations")


def make_two_experts(source: str, dest: str, boundary_ratio: float = DEFAULT_BOUNDARY) -> str:
    """Write the two-expert checkpoint of the one-expert Wan checkpoint at `source` to `dest` (which must not exist)
    and return `dest`. ValueError naming the argument before anything is written: a boundary outside (0, 1), a source
    that is not a one-expert `WanPipeline` directory, a `dest` that exists."""
    from omniroll.files import staged_directory
    from omniroll.models.checkpoint import read_model_index
    from omniroll.models.shipped import write_sums

    if not isinstance(boundary_ratio, (int, float)) or not 0.0 < float(boundary_ratio) < 1.0:
        raise ValueError(f"boundary_ratio must be in (0, 1) (the share of the timesteps above which the first expert "
                         f"runs), got {boundary_ratio!r}")
    index = read_model_index(source)
    if index.get("_class_name") != "WanPipeline" or "transformer" not in index:
        raise ValueError(f"{source}: not a Wan checkpoint (model_index.json's _class_name is "
                         f"{index.get('_class_name')!r}, not 'WanPipeline')")
    if index.get("boundary_ratio") is not None or (index.get("transformer_2") or [None])[0] is not None:
        raise ValueError(f"{source}: already has two experts (boundary_ratio {index.get('boundary_ratio')})")
    if os.path.exists(dest):
        raise ValueError(f"{dest} exists: the two-expert checkpoint is written to a new directory")
    with staged_directory(dest) as tmp:  # written whole or not at all
        shutil.rmtree(tmp)
        shutil.copytree(source, tmp, ignore=lambda d, names: [n for n in names if d == source and n in SKIPPED])
        shutil.copytree(os.path.join(source, "transformer"), os.path.join(tmp, "transformer_2"))
        index = {**index, "transformer_2": index["transformer"], "boundary_ratio": float(boundary_ratio)}
        with open(os.path.join(tmp, "model_index.json"), "w") as f:
            json.dump(index, f, indent=2, sort_keys=True)
            f.write("\n")
        write_sums(tmp)
    return dest
