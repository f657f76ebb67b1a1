"""A sample's randomness, and the trainer's: seeds that depend only on what identifies the sample, never on where it
sits in a batch (`derive_seed`, `derive_group_seed`, `derive_tree_seed`, `batch_prompt_uid`), the one generator each
request draws from (`make_generator`), and the trainer's seeds, each a function of (trainer seed, step, ...) only, so
a resumed run draws exactly as a straight one: which prompts a step rolls out (`prompt_order_seed`), its random SDE
window (`window_seed`), the inner epochs' shuffling (`shuffle_seed`), and the algorithms' own draws
(`trained_steps_seed`, `training_timesteps_seed`, `noise_term_seed`), each data-parallel rank with its own seed
(`rank_seed`).

torch-free at import: the functions that need torch import it when called.
"""

from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING, Optional

if TYPE_CHECKING:
    import torch


_MAX = 2**63 - 1


def derive_seed(base_seed: Optional[int], global_step: int, uid: str, index: int) -> int:
    """A 63-bit seed from (base seed, trainer step, prompt-group uid, index within the group).

    sha256 of a canonical encoding, so it is stable across processes, machines and Python hash seeds, and the same
    sample gets the same seed however many workers, replicas or chunks the batch is split into.
    `base_seed=None` is treated as 0 (callers that want fresh randomness pass a random base seed).
    """
    if index < 0:
        raise ValueError(f"index must be >= 0, got {index}")
    key = f"omniroll/v1|{0 if base_seed is None else int(base_seed)}|{int(global_step)}|{uid}|{int(index)}"
    digest = hashlib.sha256(key.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "little") & _MAX


def derive_group_seed(base_seed: Optional[int], global_step: int, uid: str) -> int:
    """The seed a whole prompt group shares under `same_latent` (its initial noise and SDE window): like
    `derive_seed` without the index, in its own domain so it never equals a sample's seed by construction."""
    key = f"omniroll/v1/group|{0 if base_seed is None else int(base_seed)}|{int(global_step)}|{uid}"
    return int.from_bytes(hashlib.sha256(key.encode("utf-8")).digest()[:8], "little") & _MAX


def derive_tree_seed(base_seed: Optional[int], global_step: int, uid: str, path: tuple[int, ...]) -> int:
    """The noise seed of one node of a prompt group's tree rollout: `path` () is the root (the noise before the first
    fork: every leaf's request `seed`), (c1, ..., cd) the branch taken at each of the first d forks (the noise from
    fork d on). Like `derive_seed`, in its own domain."""
    nodes = ",".join(str(int(c)) for c in path)
    key = f"omniroll/v1/tree|{0 if base_seed is None else int(base_seed)}|{int(global_step)}|{uid}|{nodes}"
    return int.from_bytes(hashlib.sha256(key.encode("utf-8")).digest()[:8], "little") & _MAX


#: the trainer step a command's batch is seeded with: `omniroll generate` and `omniroll rollout` derive every sample's
#: seed as `derive_seed(seed, CLI_GLOBAL_STEP, uid, index)`, the agent loop's own derivation, so the same prompt, seed
#: and settings give the same image in both commands.
CLI_GLOBAL_STEP = 0


def batch_prompt_uid(i: int) -> str:
    """The uid (prompt group) of the i-th prompt of a batch whose caller names none: `omniroll generate`, `omniroll
    rollout` and the HTTP `/v1/rollout` all use it, so the same prompt position, seed and settings give the same
    sample (`derive_seed(seed, global_step, batch_prompt_uid(i), j)`) whichever way it was asked for."""
    return f"prompt{int(i):05d}"


def make_generator(seed: int, device: "str | torch.device" = "cpu") -> "torch.Generator":
    """The single generator a request uses for its initial latent, its window draw and every noise draw."""
    import torch

    g = torch.Generator(device=device)
    g.manual_seed(int(seed))
    return g


# ------------------------------------------------------------------------------------------------- the trainer's
def prompt_order_seed(seed: int, step: int) -> int:
    """The permutation a trainer step picks its prompts from."""
    return int(seed) * 1_000_003 + int(step)


def window_seed(seed: int, step: int) -> int:
    """A step's random SDE window (`window_for_step` "random")."""
    return int(seed) * 7919 + int(step)


def shuffle_seed(seed: int, step: int, epoch: int) -> int:
    """The order of a step's rows in one inner epoch."""
    return (int(seed) * 1_000_003 + int(step)) * 1009 + int(epoch)


def signal_halves_seed(seed: int, step: int) -> int:
    """The gradient-signal meter: which half of a step's prompt groups each group is in."""
    return (int(seed) * 1_000_037 + int(step)) * 43 + 11


def trained_steps_seed(seed: int, step: int) -> int:
    """DanceGRPO: which window steps each row trains."""
    return (int(seed) * 1_000_033 + int(step)) * 31 + 7


def training_timesteps_seed(seed: int, step: int) -> int:
    """The forward-process algorithms (NFT, AWM): the timesteps each row trains at."""
    return (int(seed) * 1_000_037 + int(step)) * 37 + 11


def rank_seed(seed: int, rank: int) -> int:
    """A data-parallel trainer rank's seed for its shard's draws (shuffling, DanceGRPO's steps, the forward-process
    timesteps and noise): rank 0 keeps the trainer seed, the others get their own, so no two ranks draw alike."""
    return int(seed) if int(rank) == 0 else int(seed) + 104_729 * int(rank)


def noise_term_seed(seed: int, step: int, epoch: int, chunk: int, term: int) -> int:
    """The forward-process algorithms: the fresh noise of one loss term (micro-batch `chunk`, term `term`)."""
    return ((((int(seed) * 1_000_003 + int(step)) * 1009 + int(epoch)) * 9973 + int(chunk)) * 101
            + int(term)) % _MAX
