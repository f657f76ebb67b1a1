"""`TrainerRank`: one rank of the data-parallel update (`trainer.world_size` > 1), a Ray actor holding its own policy,
optimizer, algorithm and version store on its device (`trainer.device`: the GPU Ray reserved for it, or the CPU), in
one torch.distributed process group with the other ranks (nccl on GPUs, gloo on the CPU).
`omniroll/train/parallel/distributed.py` starts and drives the ranks.

Each step it receives its shard of the batch (whole prompt groups, advantages of the whole batch), runs the
algorithm's `prepare`, the generic update (`train_on_batch` with a `GradientShare`: the trainable gradients are
summed over the ranks before every clip and optimizer step, by an explicit all-reduce, or with `trainer.sharding:
fsdp` by FSDP2's reduce-scatter, train/parallel/fsdp.py) and `after_update`. The ranks start from the same weights and
optimizer state and step with the same summed gradient, so their weights stay equal. Each writes its optimizer state
(its shard, or rank 0 the replicated one) to disk every step, so the last completed step can be checkpointed whatever
happens later; rank 0 returns the weights and the algorithm state to the driver, which adopts them (and pushes the
weights to the replicas).
"""

from __future__ import annotations

import datetime
import os
import shutil
import socket
from dataclasses import dataclass, replace
from typing import Any, Optional

import torch

from omniroll.config.device import check_device_here, gradient_checkpointing, rank_device, trainer_dtype
from omniroll.engine.memory import peak_bytes
from omniroll.sampling.seeds import rank_seed
from omniroll.train.algorithms import UpdatePlan, make_algorithm
from omniroll.train.parallel import fsdp
from omniroll.train.policy import Policy
from omniroll.train.local_update import update_and_measure
from omniroll.train.update import GradientShare, UpdateResult
from omniroll.train.version_store import VersionStore

#: elements per all-reduce of the gradients (the trainable parameters are reduced in buckets of about this size)
BUCKET_NUMEL = 1 << 24


def all_reduce_gradients(params: list, group: Any = None) -> None:
    """Sum every parameter's gradient over the ranks, in place. A parameter no rank has a gradient for keeps none (the
    optimizer then skips it, as in one process); one that only some ranks have is zero on the others."""
    import torch.distributed as dist

    if not params:
        return
    has = torch.tensor([float(p.grad is not None) for p in params], device=params[0].device)
    dist.all_reduce(has, group=group)
    live = [p for p, h in zip(params, has.tolist()) if h > 0]
    for p in live:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    bucket: list = []
    numel = 0
    for i, p in enumerate(live):
        bucket.append(p)
        numel += p.numel()
        if i == len(live) - 1 or numel >= BUCKET_NUMEL:
            flat = torch.cat([q.grad.reshape(-1) for q in bucket])
            dist.all_reduce(flat, group=group)
            offset = 0
            for q in bucket:
                q.grad.copy_(flat[offset:offset + q.numel()].view_as(q.grad))
                offset += q.numel()
            bucket, numel = [], 0


def all_reduce_tensors(tensors: list, group: Any = None) -> None:
    """Sum plain tensors over the ranks, in place (one collective per dtype: the gradient-signal meter's copy of
    half A's gradient and its row counts)."""
    import torch.distributed as dist

    by_dtype: dict = {}
    for t in tensors:
        by_dtype.setdefault(t.dtype, []).append(t)
    for same in by_dtype.values():
        flat = torch.cat([t.reshape(-1) for t in same])
        dist.all_reduce(flat, group=group)
        offset = 0
        for t in same:
            t.copy_(flat[offset:offset + t.numel()].view_as(t))
            offset += t.numel()


def free_address() -> str:
    """`tcp://<this node's IP>:<a free port>`: the process group's rendezvous (asked of rank 0)."""
    from omniroll.ray_nodes import this_node

    ip = this_node()[1] or "127.0.0.1"
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        port = s.getsockname()[1]
    return f"tcp://{ip}:{port}"


def to_cpu(tree: Any) -> Any:
    """`tree` (dicts, lists, tuples of tensors and plain values) with every tensor on the CPU: what crosses Ray."""
    if isinstance(tree, torch.Tensor):
        return tree.detach().cpu()
    if isinstance(tree, dict):
        return {k: to_cpu(v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(to_cpu(v) for v in tree)
    return tree


class TrainerRank:
    """config: the OmniRollConfig; model_path: the trainer's (resolved) model; rank in [0, world_size); state_dir:
    where the ranks write each step's optimizer state (a directory every rank and the driver can read)."""

    def __init__(self, config: Any, model_path: str, rank: int, world_size: int, state_dir: str):
        tc = self.tc = config.trainer
        torch.set_num_threads(tc.num_threads or max(1, int(tc.resources.num_cpus)))
        self.rank, self.world_size, self.state_dir = rank, world_size, state_dir
        self.device = rank_device(config)  # cuda: the GPU Ray reserved for this actor
        check_device_here(self.device, trainer_dtype(config))
        self.policy = Policy(model_path, tc.mode, tc.lora.rank, tc.lora.alpha, tc.lora.target_modules,
                             dtype=trainer_dtype(config), seed=tc.seed, device=self.device)
        self.algorithm = make_algorithm(config, self.policy.adapter)
        self.optimizer: Optional[torch.optim.Optimizer] = None  # built with the process group (FSDP2 shards first)
        self.store = VersionStore(self.policy, tc.max_staleness)
        self.sharded = tc.sharding == "fsdp"
        self.checkpointing_due = gradient_checkpointing(config)  # turned on with the first rows
        self.group_started = False

    def node_id(self) -> Optional[str]:
        from omniroll.ray_nodes import this_node_id

        return this_node_id()

    def rendezvous(self) -> str:
        return free_address()

    def init_group(self, init_method: str, timeout_s: float) -> str:
        """Join the process group (every rank at once; nccl on a GPU, gloo on the CPU), shard the denoiser
        (`trainer.sharding: fsdp`), build the optimizer. Returns the backend."""
        import torch.distributed as dist

        backend = "nccl" if self.device == "cuda" else "gloo"
        dist.init_process_group(backend, init_method=init_method, rank=self.rank, world_size=self.world_size,
                                timeout=datetime.timedelta(seconds=timeout_s))
        self.group_started = True
        if self.sharded:
            fsdp.shard_denoiser(self.policy.denoiser, self.device, self.world_size)
            self.policy.pin_parameters()  # the sharded ones (FSDP2 swaps in the gathered ones around forwards)
        tc = self.tc
        self.optimizer = torch.optim.AdamW(self.policy.parameters(), lr=tc.lr, betas=tuple(tc.adam_betas),
                                           weight_decay=tc.weight_decay)
        return backend

    def load_state(self, weights: dict, optimizer: Optional[dict], algorithm: dict, snapshots: dict,
                   current: int, sharded_optimizer: Optional[str] = None) -> None:
        """The driver's trainable weights, optimizer state (a state dict, or the directory of a sharded one),
        algorithm state and kept versions (at start and resume; no optimizer state: a fresh one)."""
        if self.sharded:
            fsdp.load_full_weights(self.policy, weights)
        else:
            own = dict(self.policy.named_parameters())
            with torch.no_grad():
                for k, v in weights.items():
                    own[k].copy_(v)
        if sharded_optimizer is not None:
            fsdp.load_optimizer(self.policy.denoiser, self.optimizer, sharded_optimizer)
        elif optimizer is not None:
            self.optimizer.load_state_dict(optimizer)
        self.algorithm.load_state_dict(algorithm)
        self.store.adopt(snapshots, current)

    def update(self, rows, advantages: torch.Tensor, plan: UpdatePlan, versions: Optional[torch.Tensor],
               rows_per_update: list[int], halves: Optional[torch.Tensor] = None) -> "RankUpdate":
        """This rank's part of the step's update. Returns its `UpdateResult` (its stats, its policy move, its peak
        device memory); writes its optimizer state (`save_optimizer_state`); rank 0 adds the trained weights and the
        algorithm state (equal on every rank), which the driver adopts and pushes. `halves`: this shard's rows' half
        for the gradient-signal meter (None: no reading; always None under fsdp, whose gradients are sharded, and so are
        the plan's per-component advantages)."""
        tc = self.tc
        # 1. The shard on this rank's device; the plan with this rank's seed (its own draws), versions, store, halves.
        rows, advantages = rows.to(self.device), advantages.to(self.device)
        plan = replace(plan, seed=rank_seed(plan.seed, self.rank), versions=versions, store=self.store,
                       halves=None if self.sharded else halves,
                       components=None if self.sharded or plan.components is None else
                       {k: v.to(self.device) for k, v in plan.components.items()})
        if self.checkpointing_due and len(rows):
            from omniroll.train.recompute import enable_gradient_checkpointing

            enable_gradient_checkpointing(self.policy.denoiser, rows.execution)
            self.checkpointing_due = False
        peak_bytes(self.device)  # this step's peak starts here
        # 2. The update on the shard (omniroll/train/local_update.py), gradients summed over the ranks before every
        #    optimizer step.
        if self.sharded:  # the zero-weight micro-batch that ends each accumulation group (train/parallel/fsdp.py)
            share = GradientShare(rows_per_update, all_reduce=lambda _: fsdp.sync_gradients(self.policy,
                                                                                            rows.rows([0])))
        else:
            share = GradientShare(rows_per_update=rows_per_update, all_reduce=all_reduce_gradients,
                                  all_reduce_tensors=all_reduce_tensors)
        out = update_and_measure(self.policy, self.optimizer, self.algorithm, tc, rows, advantages, plan, share=share)
        if self.sharded:
            fsdp.reshard(self.policy.denoiser)
        self.store.record(plan.step)
        # 3. The step's optimizer state on disk (the driver reads it only for a checkpoint); the weights to push.
        self.save_optimizer_state(plan.step)
        out = replace(out, peak_bytes=peak_bytes(self.device))
        weights = self.weights()  # a collective under FSDP2: every rank gathers
        if self.rank == 0:
            return RankUpdate(out, weights, self.algorithm_state())
        return RankUpdate(out)

    def save_optimizer_state(self, step: int) -> None:
        """Step `step`'s optimizer state under `state_dir`/step_NNNNNN: each rank its shard (fsdp), or rank 0 the
        replicated one (`optimizer.pt`); the step before it is kept (the last completed step's, should this one fail
        before the driver completes it), older ones are removed."""
        path = optimizer_state_path(self.state_dir, step)
        if self.rank == 0:
            os.makedirs(path, exist_ok=True)
        if self.sharded:
            fsdp.save_optimizer(self.policy.denoiser, self.optimizer, os.path.join(path, "optimizer"))
        elif self.rank == 0:
            torch.save(to_cpu(self.optimizer.state_dict()), os.path.join(path, "optimizer.pt.tmp"))
            os.replace(os.path.join(path, "optimizer.pt.tmp"), os.path.join(path, "optimizer.pt"))
        if self.rank == 0:
            for old in range(max(step - 2, 0), 0, -1):
                old_path = optimizer_state_path(self.state_dir, old)
                if not os.path.isdir(old_path):
                    break
                shutil.rmtree(old_path, ignore_errors=True)

    def weights(self) -> dict:
        """The trainable weights by name, whole, on the CPU (under FSDP2 every rank must call it: it gathers)."""
        if self.sharded:
            return fsdp.full_weights(self.policy)
        return {k: p.detach().cpu().clone() for k, p in self.policy.named_parameters()}

    def algorithm_state(self) -> dict:
        return to_cpu(self.algorithm.state_dict())

    def close(self) -> None:
        import torch.distributed as dist

        if self.group_started:
            dist.destroy_process_group()
            self.group_started = False


@dataclass
class RankUpdate:
    """One rank's answer to `TrainerRank.update`: its `UpdateResult`, and from rank 0 the trained weights (name ->
    tensor, on the CPU) and the algorithm's state, which the driver adopts (None from the other ranks)."""

    result: UpdateResult
    weights: Optional[dict] = None
    algorithm: Optional[dict] = None


def optimizer_state_path(state_dir: str, step: int) -> str:
    """Where the ranks write step `step`'s optimizer state."""
    return os.path.join(state_dir, f"step_{step:06d}")
