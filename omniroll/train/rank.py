"""`TrainerRank`: one rank of the data-parallel update (`trainer.world_size` > 1), a Ray actor holding its own policy,
optimizer, algorithm and version store, in one torch.distributed process group with the other ranks (gloo for CPU
parameters, nccl for CUDA ones). `omniroll/train/distributed.py` starts and drives the ranks.

Each step it receives its shard of the batch (whole prompt groups, advantages of the whole batch), runs the
algorithm's `prepare`, the generic update (`train_on_batch` with a `GradientShare`: the trainable gradients are
summed over the ranks before every clip and optimizer step; not a `DistributedDataParallel` wrapper) and
`after_update`. The ranks start from the same weights and optimizer state and step with the same all-reduced
gradient, so their weights stay equal; rank 0 returns its weights, optimizer state and algorithm state to the driver,
which adopts them (and pushes the weights to the replicas).
"""

from __future__ import annotations

import datetime
import socket
from dataclasses import replace
from typing import Any, Optional

import torch

from omniroll.sampling.seeds import rank_seed
from omniroll.train.algorithms import UpdatePlan, make_algorithm
from omniroll.train.policy import Policy
from omniroll.train.update import GradientShare, train_on_batch
from omniroll.train.versions import VersionStore

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


class TrainerRank:
    """config: the OmniRollConfig; model_path: the trainer's (resolved) model; rank in [0, world_size)."""

    def __init__(self, config: Any, model_path: str, rank: int, world_size: int):
        tc = self.tc = config.trainer
        torch.set_num_threads(tc.num_threads or max(1, int(tc.resources.num_cpus)))
        self.rank, self.world_size = rank, world_size
        self.policy = Policy(model_path, tc.mode, tc.lora.rank, tc.lora.alpha, tc.lora.target_modules,
                             dtype=config.engine.dtype, seed=tc.seed)
        self.algorithm = make_algorithm(config, self.policy.adapter)
        self.optimizer = torch.optim.AdamW(self.policy.parameters(), lr=tc.lr, betas=tuple(tc.adam_betas),
                                           weight_decay=tc.weight_decay)
        self.store = VersionStore(self.policy, tc.max_staleness)
        self.checkpointing = False
        self.group_started = False

    def node_id(self) -> Optional[str]:
        from omniroll.ray_nodes import this_node_id

        return this_node_id()

    def rendezvous(self) -> str:
        return free_address()

    def init_group(self, init_method: str, timeout_s: float) -> str:
        """Join the process group (every rank at once): nccl when the trainable parameters are on a GPU, gloo
        otherwise (the trainer's policy computes on the CPU today, so gloo). Returns the backend."""
        import torch.distributed as dist

        backend = "nccl" if next(iter(self.policy.parameters())).is_cuda else "gloo"
        dist.init_process_group(backend, init_method=init_method, rank=self.rank, world_size=self.world_size,
                                timeout=datetime.timedelta(seconds=timeout_s))
        self.group_started = True
        return backend

    def load_state(self, weights: dict, optimizer: dict, algorithm: dict, snapshots: dict, current: int) -> None:
        """The driver's trainable weights, optimizer state, algorithm state and kept versions (at start and resume)."""
        own = dict(self.policy.named_parameters())
        with torch.no_grad():
            for k, v in weights.items():
                own[k].copy_(v)
        self.optimizer.load_state_dict(optimizer)
        self.algorithm.load_state_dict(algorithm)
        self.store.adopt(snapshots, current)

    def update(self, rows, advantages: torch.Tensor, plan: UpdatePlan, versions: Optional[torch.Tensor],
               rows_per_update: list[int], halves: Optional[torch.Tensor] = None) -> dict:
        """This rank's part of the step's update. Returns its stats and metrics; rank 0 adds its weights, optimizer
        state and algorithm state (equal on every rank), which the driver keeps: it can checkpoint the last completed
        step whatever happens to the ranks later."""
        tc = self.tc
        # 1. The plan with this rank's seed (its own draws), versions and store.
        plan = replace(plan, seed=rank_seed(plan.seed, self.rank), versions=versions, store=self.store, halves=halves)
        if tc.gradient_checkpointing and not self.checkpointing and len(rows):
            from omniroll.train.policy import enable_gradient_checkpointing

            enable_gradient_checkpointing(self.policy.denoiser, rows.execution)
            self.checkpointing = True
        # 2. The algorithm's anchors on the shard (none for a rank without rows: it only joins the all-reduces).
        prepared = self.algorithm.prepare(self.policy, rows, plan) if len(rows) else {}
        # 3. The update, gradients summed over the ranks before every optimizer step; the algorithm's after-update.
        share = GradientShare(rows_per_update=rows_per_update, all_reduce=all_reduce_gradients,
                              all_reduce_tensors=all_reduce_tensors)
        stats = train_on_batch(self.policy, self.optimizer, self.algorithm, rows, advantages, plan,
                               num_inner_epochs=tc.num_inner_epochs, max_grad_norm=tc.max_grad_norm, share=share)
        after = self.algorithm.after_update(self.policy, plan.step)
        self.store.record(plan.step)
        out = {"stats": stats, "prepared": prepared, "after": after}
        if self.rank == 0:
            out["weights"] = self.weights()
            out["algorithm"] = self.algorithm_state()
            out["optimizer"] = self.optimizer.state_dict()
        return out

    def weights(self) -> dict:
        """This rank's trainable weights by name (tests compare the ranks with them)."""
        return {k: p.detach().cpu().clone() for k, p in self.policy.named_parameters()}

    def algorithm_state(self) -> dict:
        return self.algorithm.state_dict()

    def close(self) -> None:
        import torch.distributed as dist

        if self.group_started:
            dist.destroy_process_group()
            self.group_started = False
