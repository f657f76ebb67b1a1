"""`FlowGRPOTrainer`: Flow-GRPO end to end on omniroll's public pieces.

One step: (1) roll out `prompts_per_step` prompts x `n` samples through the `AgentLoopManager` (replicas are Ray
actors; rewards stream while generation runs); (2) GRPO advantages per prompt group; (3) inner epochs over shuffled
micro-batches and every recorded window step (`train_on_batch`, recompute by `recompute_log_probs`); (4) push the new
weights to every replica through `WeightSender` (version = the step) and wait for every ack; (5) log and checkpoint.

Every sample's `weight_version` must equal the version pushed before its rollout (else `WeightVersionError`), and
`ratio_max_abs_dev` (max |ratio - 1| before the step's first optimizer update) is logged every step: exactly 0.0 with
the engine's batch-invariant mode.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import time
from typing import Any, Callable, Optional

import torch

from omniroll.agent_loop.batch import DataBatch, prompt_batch
from omniroll.config import OmniRollConfig, load_config
from omniroll.sampling.seeds import batch_prompt_uid
from omniroll.sampling.window import window_for_step
from omniroll.train import artifacts
from omniroll.train.grpo import group_advantages
from omniroll.train.policy import Policy
from omniroll.train.tracking import Tracker
from omniroll.train.trajectory import TrajectoryBatch
from omniroll.train.update import train_on_batch


class WeightVersionError(RuntimeError):
    """A sample was generated with weights other than the ones pushed before its rollout."""


class FlowGRPOTrainer:
    """config: an OmniRollConfig (or a path / dict) with a `trainer` section. out_dir: metrics.jsonl, reward_curve.png,
    validation grids, checkpoints. resume: a run directory or one of its checkpoint directories."""

    def __init__(self, config: Any, out_dir: str, resume: Optional[str] = None,
                 log: Callable[[str], None] = print, ray_address: Optional[str] = None):
        self.config: OmniRollConfig = config if isinstance(config, OmniRollConfig) else load_config(config)
        if self.config.trainer is None:
            raise ValueError("trainer: the config has no trainer section")
        self.tc = self.config.trainer
        self.out_dir = out_dir
        self.resume_from = artifacts.find_checkpoint(resume) if resume else None  # fails before Ray starts
        self.log = log
        self.prompts = self.tc.all_prompts()
        self.val_prompts = list(self.tc.val_prompts) or self.prompts[:4]
        self.step_done = 0  # last completed training step
        self.version = 0  # weights version on every replica
        self.replicas: list = []
        self.reward_handles: list = []
        self.manager = None
        self.cluster = None  # omniroll.agent_loop.cluster.RolloutCluster while started
        self.ray_address = ray_address  # a cluster to join (default: RAY_ADDRESS, else a local Ray)
        self.history: list[dict] = []
        self._pending_interrupt = False
        self._critical = False
        self._checkpointing = False
        self._threads_before: Optional[int] = None
        self.tracker: Optional[Tracker] = None
        self._tracking_state: Optional[dict] = None  # a resumed run's tracker run ids (from the checkpoint)

    # ------------------------------------------------------------------ setup / teardown
    def start(self) -> "FlowGRPOTrainer":
        import ray

        from omniroll.agent_loop.cluster import RolloutCluster

        cfg = self.config
        if self.tc.num_threads is not None:  # restored by close()
            self._threads_before = torch.get_num_threads()
            torch.set_num_threads(self.tc.num_threads)
        os.makedirs(self.out_dir, exist_ok=True)
        if not self.resume_from:  # a fresh run starts fresh logs (a resumed one appends to them)
            for name in ("metrics.jsonl", "validation.jsonl"):
                with contextlib.suppress(FileNotFoundError):
                    os.remove(os.path.join(self.out_dir, name))
        self.cluster = RolloutCluster(cfg, ray_address=self.ray_address, log=self.log)  # resolves the model
        self.policy = Policy(self.cluster.model, self.tc.mode, self.tc.lora.rank, self.tc.lora.alpha,
                             self.tc.lora.target_modules, dtype=cfg.engine.dtype, seed=self.tc.seed)
        self.optimizer = torch.optim.AdamW(self.policy.parameters(), lr=self.tc.lr, betas=tuple(self.tc.adam_betas),
                                           weight_decay=self.tc.weight_decay)
        if self.resume_from:
            self._load(self.resume_from)
        self.tracker = Tracker(self.config, self.out_dir, self._tracking_state, log=self.log)
        self.cluster.start()  # Ray (joined or local), replicas, reward workers, agent-loop manager
        self._adopt_cluster()
        current = max(ray.get([r.health.remote() for r in self.replicas])[i]["weight_version"]
                      for i in range(len(self.replicas)))
        if current > self.step_done or (self.step_done > 0 and current == self.step_done):
            raise WeightVersionError(f"replicas are at weight version {current}, ahead of this run's step "
                                     f"{self.step_done}: start the trainer with fresh replicas")
        if self.step_done > 0:  # resumed: the replicas start from the checkpoint's weights
            self._sync(self.step_done)
        self.version = self.step_done
        return self

    def _adopt_cluster(self) -> None:
        """The cluster's replicas, reward workers and manager (again after `prune`), and a sender to the replicas."""
        from omniroll.weights import WeightSender

        self.replicas = self.cluster.replicas
        self.reward_handles = self.cluster.reward_workers
        self.manager = self.cluster.manager
        self.sender = WeightSender(self.replicas, transport=self.tc.weight_transport, timeout_s=self.tc.sync_timeout_s)

    def _continue_without_lost_replicas(self) -> bool:
        """Drop replicas whose node left the cluster; says so in one line. Returns whether any was lost."""
        lost = self.cluster.prune()
        if lost:
            nodes = sorted({str(x["node_id"]) for x in lost})
            self.log(f"lost {len(lost)} replica(s) (node(s) {', '.join(nodes)} left the cluster): continuing with "
                     f"{len(self.cluster.replicas)} replica(s)")
            self._adopt_cluster()
        return bool(lost)

    def close(self) -> None:
        if self.cluster is not None:
            self.cluster.close()  # the manager, reward workers, replicas, placement groups, Ray: in reverse
            self.cluster = None
        self.manager, self.reward_handles, self.replicas = None, [], []
        if self.tracker is not None:
            self.tracker.close()
            self.tracker = None
        if self._threads_before is not None:
            torch.set_num_threads(self._threads_before)
            self._threads_before = None

    def __enter__(self) -> "FlowGRPOTrainer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------------ the loop
    def train(self, steps: Optional[int] = None, progress: bool = False,
              on_step: Optional[Callable[[dict], None]] = None) -> list[dict]:
        """Run until step `steps` (default: trainer.steps). On Ctrl-C the state of the last completed step is written
        as a checkpoint and KeyboardInterrupt is re-raised (a step's update and sync are never cut in half)."""
        last = int(steps or self.tc.steps)
        bar = None
        if progress:
            from tqdm import tqdm

            bar = tqdm(total=last, initial=self.step_done, desc="train", unit="step", dynamic_ncols=True)
        old = signal.getsignal(signal.SIGINT)
        with contextlib.suppress(ValueError):  # not the main thread: keep the default handler
            signal.signal(signal.SIGINT, self._on_sigint)
        try:
            if self.step_done == 0 and not self.resume_from:
                self.validate("before")
            while self.step_done < last:
                m = self.step(self.step_done + 1)
                if bar is not None:
                    bar.update(1)
                    bar.set_postfix(reward=f"{m['reward_mean']:.3f}", dev=m["ratio_max_abs_dev"])
                if on_step is not None:
                    on_step(m)
                if self.tc.checkpoint_every and self.step_done % self.tc.checkpoint_every == 0:
                    self.save_checkpoint()
                if self.tc.val_every and self.step_done % self.tc.val_every == 0 and self.step_done < last:
                    self.validate(f"step{self.step_done:06d}")
            self.validate("after")
            self.save_checkpoint()
        except KeyboardInterrupt:
            self.log(f"interrupted: writing the checkpoint of step {self.step_done}")
            self.save_checkpoint()
            raise
        finally:
            with contextlib.suppress(ValueError):
                signal.signal(signal.SIGINT, old)
            if bar is not None:
                bar.close()
            artifacts.plot_rewards(self.history_all() or self.history, os.path.join(self.out_dir, "reward_curve.png"))
        return self.history

    def _on_sigint(self, signum, frame) -> None:
        if self._critical:
            self._pending_interrupt = True  # raised once this step's update and sync are complete
            return
        raise KeyboardInterrupt

    @contextlib.contextmanager
    def _uninterruptible(self):
        self._critical = True
        try:
            yield
        finally:
            self._critical = False
        if self._pending_interrupt:
            self._pending_interrupt = False
            raise KeyboardInterrupt

    def step(self, step: int) -> dict:
        t0 = time.perf_counter()
        wall0 = time.time()
        out = self._rollout(step)
        wall_back = time.time()
        finished = [m.get("generate_finished_at") or wall_back for m in out.meta_info.get("metrics", [])]
        last_gen = max(finished) if finished else wall_back
        versions = [int(v) for v in out.non_tensor_batch["weight_version"]]
        wrong = [(out.non_tensor_batch["request_id"][i], v) for i, v in enumerate(versions) if v != self.version]
        if wrong:
            raise WeightVersionError(f"step {step}: {len(wrong)} sample(s) were generated with weights other than "
                                     f"version {self.version}: {wrong[:8]}")
        rewards = out.batch["rm_scores"][:, 0].float()
        adv = group_advantages(rewards, list(out.non_tensor_batch["uid"]), self.tc.global_std, self.tc.adv_clip_max)
        traj = TrajectoryBatch.from_batch(out)
        if self.tc.gradient_checkpointing and not self._checkpointing:  # in the mode the rollout recorded
            from omniroll.train.recompute import enable_gradient_checkpointing

            enable_gradient_checkpointing(self.policy.denoiser, traj.execution)
            self._checkpointing = True
        t1 = time.perf_counter()
        with self._uninterruptible():
            stats = train_on_batch(
                self.policy, self.optimizer, traj, adv.advantages, step=step, seed=self.tc.seed,
                num_inner_epochs=self.tc.num_inner_epochs, micro_batch_size=self.tc.micro_batch_size,
                micro_batches_per_update=self.tc.micro_batches_per_update, clip_range=self.tc.clip_range,
                kl_beta=self.tc.kl_beta, max_grad_norm=self.tc.max_grad_norm)
            t2 = time.perf_counter()
            self._sync(step)
            self.step_done = step
            t3 = time.perf_counter()
            m = {"step": step, "reward_mean": float(rewards.mean()), "reward_std": float(rewards.std(unbiased=False)),
                 "tied_groups": adv.tied_groups, "num_groups": adv.num_groups, "num_samples": len(traj),
                 "ratio_max_abs_dev": stats.ratio_max_abs_dev, "clip_frac": stats.clip_frac,
                 "approx_kl": stats.approx_kl, "loss": stats.loss, "policy_loss": stats.policy_loss, "kl": stats.kl,
                 "grad_norm": stats.grad_norm, "optimizer_steps": stats.optimizer_steps,
                 "weight_version": versions[0], "synced_version": self.version,
                 "rollout_s": max(last_gen - wall0, 0.0), "reward_wait_s": max(wall_back - last_gen, 0.0),
                 "train_s": t2 - t1, "sync_s": t3 - t2, "step_s": t3 - t0}
            self.history.append(m)  # a Ctrl-C during the update lands after this step is logged
            self.tracker.log_step(m, out)  # the step line, metrics.jsonl, trackers (trainer.logger)
        return m

    def _rollout(self, step: int) -> DataBatch:
        n, P = self.config.n, self.tc.prompts_per_step
        g = torch.Generator().manual_seed(self.tc.seed * 1_000_003 + step)
        picks = torch.randperm(len(self.prompts), generator=g)[:P].tolist()
        meta = {"global_steps": step, "rollout_seed": self.config.seed or 0}
        a, tc = self.config.algo, self.tc
        window = window_for_step(tc.window_schedule, step, self.config.pipeline.num_inference_steps,
                                 a.sde_window_size, a.sde_window_range, tc.seed, tc.window_advance_every)
        if window is not None:
            meta["sampling_params"] = {"sde_window_range": window}
        # uid: the prompt's index in the training prompt list (the same function as the CLI's position uid)
        batch = prompt_batch(self.prompts, n, batch_prompt_uid, indices=picks, data_source="train", meta_info=meta)
        return asyncio.run(self.manager.generate_sequences_async(batch))

    def _sync(self, version: int) -> None:
        """Push `version` to every replica. Replicas whose node left the cluster are dropped first (one line); a sync
        that fails because a receiver disappeared meanwhile is completed on the survivors."""
        from omniroll.weights import WeightSyncError

        self._continue_without_lost_replicas()
        try:
            acks = self.sender.send(self.policy.weights_to_send(), version=version)
        except WeightSyncError:
            if not self._continue_without_lost_replicas():
                raise
            acks = self._sync_survivors(version)
        bad = [a for a in acks if int(a.get("version", -1)) != version]
        if len(acks) != len(self.replicas) or bad:
            raise WeightVersionError(f"weight sync to version {version}: acks {acks}")
        self.version = version

    def _sync_survivors(self, version: int) -> list[dict]:
        """After a sync that lost a receiver: send `version` to the survivors that do not have it yet."""
        import ray

        from omniroll.weights import WeightSender

        have = [int(h["weight_version"]) for h in ray.get([r.health.remote() for r in self.replicas])]
        behind = [r for r, v in zip(self.replicas, have) if v < version]
        acks = [{"version": v} for v in have if v >= version]
        if behind:
            acks += WeightSender(behind, transport=self.tc.weight_transport,
                                 timeout_s=self.tc.sync_timeout_s).send(self.policy.weights_to_send(), version=version)
        return acks

    # ------------------------------------------------------------------ validation and checkpoints
    def validate(self, tag: str) -> dict:
        k = self.config.val_kwargs.n
        batch = prompt_batch(self.val_prompts, k, lambda i: f"val{i:04d}", data_source="val",
                             meta_info={"validate": True})
        out = asyncio.run(self.manager.generate_sequences_async(batch))
        path = os.path.join(self.out_dir, f"val_{tag}.png")
        artifacts.save_val_grid(out.batch["responses"], len(self.val_prompts), k, path)
        score = float(out.batch["rm_scores"].mean()) if "rm_scores" in out.batch.keys() else None
        rec = {"tag": tag, "step": self.step_done, "val_reward_mean": score, "grid": path}
        artifacts.append_jsonl(os.path.join(self.out_dir, "validation.jsonl"), rec)
        self.tracker.log_validation(tag, self.step_done, out, score, path)
        self.log(f"validation {tag}: reward {score:.4f} -> {path}" if score is not None else f"validation {tag}")
        return rec

    def save_checkpoint(self) -> str:
        path = os.path.join(self.out_dir, "checkpoints", f"step_{self.step_done:06d}")
        self.policy.save(path)
        torch.save({"step": self.step_done, "version": self.version, "optimizer": self.optimizer.state_dict(),
                    "mode": self.tc.mode, "config": self.config.model_dump(mode="json"),
                    "tracking": self.tracker.state(self.step_done) if self.tracker else None},
                   os.path.join(path, "trainer_state.pt"))
        with open(os.path.join(self.out_dir, "checkpoints", "latest"), "w") as f:
            f.write(os.path.basename(path) + "\n")
        return path

    def _load(self, path: str) -> None:
        state = artifacts.read_trainer_state(path)  # weights_only: a resume directory cannot run code
        if state["mode"] != self.tc.mode:
            raise ValueError(f"trainer.mode: the checkpoint {path} was trained with mode {state['mode']!r}")
        self.policy.load(path)
        self.optimizer.load_state_dict(state["optimizer"])
        self.step_done = int(state["step"])
        self._tracking_state = state.get("tracking")
        self.log(f"resumed from {path} (step {self.step_done})")

    def history_all(self) -> list[dict]:
        """Every step's metrics in this out_dir (a resumed run appends to them)."""
        return artifacts.read_jsonl(os.path.join(self.out_dir, "metrics.jsonl"))
