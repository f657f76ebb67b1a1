"""`trainer.sharding: fsdp`: a data-parallel rank's denoiser under FSDP2 (`torch.distributed.fsdp.fully_shard`), with
its optimizer state sharded over the ranks and its gradients reduce-scattered, in a collective sequence that does not
depend on the rank's rows.

Every FSDP2 collective must be issued by every rank in the same order, but the update scores a micro-batch in a
data-dependent number of forward calls (one per prompt-length group) and a rank may have fewer micro-batches than
another. So (docs/training/gpu.md):

* each transformer block and the root are sharded with `reshard_after_forward=False`, and between two optimizer
  steps the gradients are not synchronised and the weights not resharded (`begin_accumulation`): the first forward of
  an accumulation group all-gathers every unit once, any number of forwards and backwards follow on the gathered
  weights, locally;
* before every optimizer step (`GradientShare.all_reduce`'s place in the update loop) each rank runs one
  zero-weight micro-batch (`sync_gradients`: one row, one forward, a backward of zero) with gradient sync on: the
  one backward whose reduce-scatter sums the accumulated gradients over the ranks (a sum: the loss is already
  scaled by the rank's share), after which the weights are resharded. Every rank issues one all-gather and one
  reduce-scatter per unit per optimizer step, whatever its rows, including a rank with no rows in that step.

Between steps (the rollout, the optimizer step) a rank holds 1 / N of the weights, gradients and AdamW moments; within
an accumulation group the whole weights and gradients (ZeRO-2's memory, not ZeRO-3's: see the memory table).
"""

from __future__ import annotations

import os
import shutil

import torch

from omniroll.engine.execution import execution_mode
from omniroll.models.base import denoiser_experts
from omniroll.train.recompute import trajectory_velocity


def fsdp_modules(module: torch.nn.Module) -> list:
    from torch.distributed.fsdp import FSDPModule

    return [m for m in module.modules() if isinstance(m, FSDPModule)]


def shard_denoiser(denoiser: torch.nn.Module, device: str, world_size: int) -> None:
    """fully_shard every transformer block (the classes diffusers names in `_no_split_modules`) and the denoiser
    itself over all ranks, gradients summed (not averaged); then the first accumulation group begins."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(torch.device(device).type, (world_size,))
    experts = denoiser_experts(denoiser).values()  # each expert of a two-expert model
    blocks = {b for e in experts for b in getattr(e, "_no_split_modules", None) or ()}
    if not blocks:
        raise ValueError(f"trainer.sharding: fsdp shards a denoiser by its transformer blocks, and "
                         f"{type(denoiser).__name__} names none (_no_split_modules)")
    for m in list(denoiser.modules()):
        if m is not denoiser and type(m).__name__ in blocks:
            fully_shard(m, mesh=mesh, reshard_after_forward=False)
    fully_shard(denoiser, mesh=mesh, reshard_after_forward=False)
    for m in fsdp_modules(denoiser):
        m.set_gradient_divide_factor(1.0)  # the loss carries the rank's share: sum the ranks' gradients
        m.set_force_sum_reduction_for_comms(True)  # a plain SUM (gloo has no PREMUL_SUM)
    begin_accumulation(denoiser)


def begin_accumulation(denoiser: torch.nn.Module) -> None:
    """Until the next `sync_gradients`: gradients accumulate locally on the gathered weights."""
    for m in fsdp_modules(denoiser):
        m.set_requires_gradient_sync(False, recurse=False)
        m.set_reshard_after_backward(False, recurse=False)


def sync_gradients(policy, row) -> None:
    """The accumulation group's end on every rank (module doc): one zero-weight forward and backward of `row` (one
    row of the rank's batch) with gradient sync on, so the accumulated gradients are summed over the ranks and the
    weights resharded; then the next group begins."""
    denoiser = policy.denoiser
    for m in fsdp_modules(denoiser):
        m.set_requires_gradient_sync(True, recurse=False)
        m.set_reshard_after_backward(True, recurse=False)
    with execution_mode(row.execution):  # a TrajectoryBatch row (the SDE-window algorithms: config/device.py)
        v = trajectory_velocity(policy.adapter, row, row.latents[:, 0], row.timesteps[:, 0], 0)
    (v.sum() * 0.0).backward()
    begin_accumulation(denoiser)


def reshard(denoiser: torch.nn.Module) -> None:
    """Free the gathered weights a no-grad forward left behind (a local operation)."""
    for m in fsdp_modules(denoiser):
        m.reshard()


def full_weights(policy) -> dict:
    """Every trainable weight, whole, on the CPU (an all-gather per weight: every rank calls it, in one order)."""
    return {k: p.full_tensor().detach().to("cpu", copy=True) for k, p in policy.named_parameters()}


def load_full_weights(policy, weights: dict) -> None:
    """Each rank's shard of `weights` (whole tensors every rank holds; no communication)."""
    from torch.distributed.tensor import distribute_tensor

    with torch.no_grad():
        for k, p in policy.named_parameters():
            full = weights[k].to(device=p.device, dtype=p.dtype)
            p.copy_(distribute_tensor(full, p.device_mesh, p.placements, src_data_rank=None))


# ------------------------------------------------------------------------------------ the sharded optimizer state
def save_optimizer(denoiser: torch.nn.Module, optimizer, path: str) -> None:
    """Every rank its shard of the AdamW state, with torch.distributed.checkpoint (a directory, loadable at another
    world size); a collective. Written into `path`.tmp and renamed by rank 0 once complete."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    tmp = path + ".tmp"
    if dist.get_rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)
    dist.barrier()
    dcp.save({"optimizer": get_optimizer_state_dict(denoiser, optimizer)}, checkpoint_id=tmp)
    if dist.get_rank() == 0:
        shutil.rmtree(path, ignore_errors=True)
        os.replace(tmp, path)


def load_optimizer(denoiser: torch.nn.Module, optimizer, path: str) -> None:
    """The AdamW state `save_optimizer` wrote (resharded to this world size by torch.distributed.checkpoint)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

    state = {"optimizer": get_optimizer_state_dict(denoiser, optimizer)}
    dcp.load(state, checkpoint_id=path)
    set_optimizer_state_dict(denoiser, optimizer, state["optimizer"])
