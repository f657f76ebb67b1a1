"""Level B's seeds, the same as VeRL-Omni's own agent loop gives (level A), from what a run can reproduce.

VeRL-Omni (`agent_loop/utils.py` at a1139ba): per step, `base = rollout.seed + global_steps - 1`; per row,
`(base * 1_000_003 + idx) mod (2**63 - 1)` where `idx` is the row's `_rollout_seed_global_idx` (the trainer's arange
over the batch after its n-fold interleaved repeat, so it encodes the prompt's position and the row's index in its
group). The per-step `uid` (a fresh uuid4 every step in VeRL-Omni's trainer) never enters, so the same `rollout.seed`
gives the same samples in every run, under any chunking across workers. `rollout.seed: null` counts as 0 (VeRL-Omni
would send no seed and its server would draw a fresh one; omniroll stays reproducible).

With `algo.same_latent` a group shares its initial noise: `latent_seed` is derived from the group's position
(`_rollout_seed_global_idx // n`) in the same way, never from the uid.
"""

from __future__ import annotations

from typing import Any, Optional

from omniroll.sampling.seeds import derive_group_seed

SEED_MULTIPLIER = 1_000_003
SEED_MODULUS = 2**63 - 1


def verl_omni_seed(rollout_seed: Optional[int], global_steps: int, global_index: int) -> int:
    """VeRL-Omni's seed of the row at `global_index` of step `global_steps`."""
    base = (0 if rollout_seed is None else int(rollout_seed)) + int(global_steps) - 1
    return (base * SEED_MULTIPLIER + int(global_index)) % SEED_MODULUS


def reseed_rows(rows: list[dict], meta_info: dict, config_seed: Optional[int], n: int) -> list[dict]:
    """Give training rows that carry `_rollout_seed_global_idx` VeRL-Omni's seeds (in place; returns `rows`).
    Validation rows keep omniroll's validation seeds (`val_kwargs`)."""
    if meta_info.get("validate", False):
        return rows
    base = meta_info.get("rollout_seed", config_seed)
    step = int(meta_info["global_steps"])
    for row in rows:
        g: Any = row.get("_rollout_seed_global_idx")
        if g is None:
            continue
        row["seed"] = verl_omni_seed(base, step, int(g))
        if "latent_seed" in row:
            row["latent_seed"] = derive_group_seed(base, step, f"verl-group-{int(g) // max(n, 1)}")
    return rows
