"""`Trainer`: the training loop, end to end on omniroll's public pieces, for every algorithm of
`trainer.algorithm` (omniroll/train/algorithms/: Flow-GRPO by default; the loop never branches on the name).

One step (`step`, top to bottom): (1) roll out `prompts_per_step` prompts x `n` samples through the
`AgentLoopManager` with the algorithm's sampling overrides (replicas are Ray actors; rewards stream while generation
runs); (2) the algorithm's advantages per prompt group; (3) its anchors (`prepare`), then inner epochs over shuffled
micro-batches and its loss terms (`train/update.py`; with `trainer.world_size` N > 1 on N ranks, each a shard of whole
prompt groups: `train/parallel/distributed.py`); (4) push the weights the replicas sample with to every replica through
`WeightSender` (version = the step) and wait for every ack; (5) log and checkpoint.

A version the trainer never pushed raises `WeightVersionError`; `ratio_max_abs_dev` (max |ratio - 1| before the
step's first optimizer update) is logged every step: exactly 0.0 with the engine's batch-invariant mode. With
`trainer.max_staleness` K >= 1 (docs/training/async.md) the rollouts of steps t+1..t+K run on a background
event loop (`RolloutPipeline`) while step t trains, the loss is decoupled PPO (`train/algorithms/ppo.py`), and a sample
trains only if every window step ran with a version >= current - K (`on_stale`).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from typing import Any, Callable, Optional

import torch

from omniroll.agent_loop.batch import DataBatch
from omniroll.config import OmniRollConfig, load_config
from omniroll.config.device import check_device_here, gradient_checkpointing, trainer_dtype
from omniroll.train import checkpoint
from omniroll.train.algorithms import UpdatePlan, make_algorithm
from omniroll.train.async_rollout import RolloutPipeline
from omniroll.train.colocation import Colocation
from omniroll.train.component_signal import ComponentWindow, step_components
from omniroll.train.grad_signal import SignalWindow, signal_halves, signal_metrics
from omniroll.train.interrupts import DeferredInterrupt
from omniroll.train.micro_batches import group_index
from omniroll.train.parallel.distributed import TrainerRankError
from omniroll.train.parallel.updater import driver_device, start_updater
from omniroll.train.policy import Policy
from omniroll.train.report import tracking
from omniroll.train.report.held_out import HeldOutRewards
from omniroll.train.report.reward_curve import plot_rewards
from omniroll.train.report.step_record import StepClock, step_record
from omniroll.train.report.signal_check import LearningSignalCheck, NoLearningSignal
from omniroll.train.report.stage_memory import StageMemory
from omniroll.train.report.task_eval import TaskEvaluation
from omniroll.train.report.tracking import Tracker
from omniroll.train.report.validation import run_validation, validation_guidance
from omniroll.train.resume import RunResume
from omniroll.train.reward_controls import RewardControls
from omniroll.train.step_prompts import step_prompt_batch
from omniroll.train.staleness import WeightVersionError, trainable_rows
from omniroll.train.version_store import VersionStore
from omniroll.train.weight_push import WeightPush, WeightPushError


class Trainer:
    """config: an OmniRollConfig (or a path / dict) with a `trainer` section. out_dir: metrics.jsonl, reward_curve.png,
    validation grids, checkpoints. resume: a run directory or one of its checkpoint directories."""

    def __init__(self, config: Any, out_dir: str, resume: Optional[str] = None,
                 log: Callable[[str], None] = print, ray_address: Optional[str] = None):
        self.config: OmniRollConfig = config if isinstance(config, OmniRollConfig) else load_config(config)
        if self.config.trainer is None:
            raise ValueError("trainer: the config has no trainer section")
        self.tc = self.config.trainer
        self.out_dir = out_dir
        self.resume = RunResume(resume) if resume else None  # finds the checkpoint: fails before Ray starts
        self.log = log
        self.prompts = self.tc.all_prompts()
        self.val_prompts = list(self.tc.val_prompts) or self.prompts[:4]
        self.step_done = 0  # last completed training step
        self.version = 0  # weights version on every replica
        self.cluster = None  # omniroll.agent_loop.cluster.RolloutCluster while started (its replicas, manager)
        self.push: Optional[WeightPush] = None  # the weights to the cluster's replicas (train/weight_push.py)
        self.updater = None  # who runs the step's update: this process or the ranks (train/parallel/updater.py)
        self.ray_address = ray_address  # a cluster to join (default: RAY_ADDRESS, else a local Ray)
        self.history: list[dict] = []
        self.interrupts = DeferredInterrupt()
        self._checkpointing = False
        self._threads_before: Optional[int] = None
        self.pipeline: Optional[RolloutPipeline] = None
        self.discarded_samples = 0  # in-flight samples of coming steps discarded at Ctrl-C
        self._last = self.tc.steps
        self.tracker: Optional[Tracker] = None
        self.task_eval = TaskEvaluation(self.config, out_dir) if self.tc.evaluation is not None else None
        self.held_out = HeldOutRewards(self.config.reward.held_out, out_dir) if self.config.reward.held_out else None
        self.signal_window = SignalWindow(self.tc.signal_check.grad_cos_window)  # the meter's last readings
        self.component_window = ComponentWindow()  # the meter per reward component (trainer.signal_components)
        rep = self.config.replicas  # replicas on the trainer's device sleep during its update (train/colocation.py)
        self.colocation = Colocation(rep.sleep_level, self.tc.sync_timeout_s) if rep.colocate else None
        self.memory: Optional[StageMemory] = None  # peak memory per stage, where the device reports it
        # set by start(): the trained model, its algorithm and optimizer, the kept weight versions, the weight sender
        self.device = "cpu"  # trainer.device (the driver's CPU when ranks train)
        self.policy: Optional[Policy] = None
        self.algorithm = None
        self.controls = RewardControls(config)  # against reward hacking: GARDO's gate and bonus, DDRL's regulariser
        self.optimizer: Optional[torch.optim.Optimizer] = None
        self.store: Optional[VersionStore] = None

    # ------------------------------------------------------------------ setup / teardown
    def start(self) -> "Trainer":
        import ray

        from omniroll.agent_loop.cluster import RolloutCluster

        cfg = self.config
        self.device = driver_device(cfg)  # the ranks compute on their own device (train/parallel/rank.py)
        check_device_here(self.device, trainer_dtype(cfg))  # before anything loads
        if self.tc.num_threads is not None:  # restored by close()
            self._threads_before = torch.get_num_threads()
            torch.set_num_threads(self.tc.num_threads)
        os.makedirs(self.out_dir, exist_ok=True)
        if self.resume is None:  # a fresh run starts fresh logs (a resumed one appends to them)
            for name in ("metrics.jsonl", "validation.jsonl"):
                with contextlib.suppress(FileNotFoundError):
                    os.remove(os.path.join(self.out_dir, name))
        self.cluster = RolloutCluster(cfg, ray_address=self.ray_address, log=self.log)  # resolves the model
        self.policy = Policy(self.cluster.model, self.tc.mode, self.tc.lora.rank, self.tc.lora.alpha,
                             self.tc.lora.target_modules, dtype=trainer_dtype(cfg), seed=self.tc.seed,
                             device=self.device, kl_reference=self.tc.kl_reference,
                             kl_reference_decay=self.tc.kl_reference_decay,
                             kl_reference_every=self.tc.kl_reference_every)
        self.algorithm = make_algorithm(cfg, self.policy.adapter)
        self.controls.start(self.policy.adapter, self.prompts)
        self.optimizer = torch.optim.AdamW(self.policy.parameters(), lr=self.tc.lr, betas=tuple(self.tc.adam_betas),
                                           weight_decay=self.tc.weight_decay)
        self.store = VersionStore(self.policy, self.tc.max_staleness)
        self.store.record(0)
        self.memory = StageMemory(self.device, cfg.engine.device)
        resume = self.resume
        if resume is not None:
            resume.load(self.tc, self.policy, self.algorithm, self.optimizer, self.store, self.log)
            self.step_done, self.discarded_samples = resume.step, resume.discarded_samples
            self.controls.load_state_dict(resume.controls)
        self.tracker = Tracker(self.config, self.out_dir, resume and resume.tracking, log=self.log)
        self.cluster.start()  # Ray (joined or local), replicas, reward workers, agent-loop manager
        self.push = WeightPush(self.cluster, transport=self.tc.weight_transport, timeout_s=self.tc.sync_timeout_s,
                               log=self.log)
        if self.colocation is not None:
            self.colocation.check(self.replicas, self.device)
        self.updater = start_updater(cfg, self.cluster.model, self.out_dir, self.log, policy=self.policy,
                                     optimizer=self.optimizer, algorithm=self.algorithm, store=self.store,
                                     memory=self.memory, sharded_optimizer=resume and resume.sharded_optimizer)
        self.pipeline = RolloutPipeline(self._rollout, rows_per_batch=self.config.n * self.tc.prompts_per_step)
        current = max(ray.get([r.health.remote() for r in self.replicas])[i]["weight_version"]
                      for i in range(len(self.replicas)))
        if current > self.step_done or (self.step_done > 0 and current == self.step_done):
            raise WeightVersionError(f"replicas are at weight version {current}, ahead of this run's step "
                                     f"{self.step_done}: start the trainer with fresh replicas")
        if resume is not None:  # the replicas start from the checkpoint's weights (and in-flight batches)
            resume.regenerate(self.pipeline, self.tc, self._sync, self.store, self.version, self.log)
        self.version = self.step_done
        return self

    @property
    def replicas(self) -> list:
        """The cluster's rollout replicas (Ray actor handles; [] before start and after close)."""
        return self.cluster.replicas if self.cluster is not None else []

    @property
    def manager(self):  # the cluster's `AgentLoopManager` (None before start and after close)
        return self.cluster.manager if self.cluster is not None else None

    @property
    def sender(self):  # the `WeightSender` to the replicas (None before start)
        return self.push.sender if self.push is not None else None

    def close(self) -> None:
        if self.pipeline is not None:
            self.pipeline.close()
            self.pipeline = None
        if self.updater is not None:
            self.updater.close()
            self.updater = None
        if self.cluster is not None:
            self.cluster.close()  # the manager, reward workers, replicas, placement groups, Ray: in reverse
            self.cluster = None
        self.push = None
        if self.tracker is not None:
            self.tracker.close()
            self.tracker = None
        if self._threads_before is not None:
            torch.set_num_threads(self._threads_before)
            self._threads_before = None

    def __enter__(self) -> "Trainer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------------ the loop
    def train(self, steps: Optional[int] = None, progress: bool = False,
              on_step: Optional[Callable[[dict], None]] = None) -> list[dict]:
        """Run until step `steps` (default: trainer.steps). On Ctrl-C the state of the last completed step is written
        as a checkpoint and KeyboardInterrupt is re-raised (a step's update and sync are never cut in half).

        A resumed run regenerates, in `start()`, the batches in flight at its checkpoint up to `trainer.steps`: a
        `steps` that would need other in-flight batches raises ValueError before any step (set `trainer.steps`)."""
        last = int(steps or self.tc.steps)
        if self.resume is not None:
            self.resume.check_steps(last, self.tc)
        self._last = last
        bar = None
        if progress:
            from tqdm import tqdm

            bar = tqdm(total=last, initial=self.step_done, desc="train", unit="step", dynamic_ncols=True)
        try:
            with self.interrupts.installed():  # a Ctrl-C during a step's update and sync waits for their end
                self._run(last, bar, on_step)
        except NoLearningSignal:
            self.save_checkpoint()  # the last completed step; the caller says why the run stopped
            raise
        except (KeyboardInterrupt, TrainerRankError) as e:  # Ctrl-C, or a data-parallel rank that died or failed
            n = self.pipeline.discard() if self.pipeline is not None else 0
            self.discarded_samples += n
            why = "interrupted" if isinstance(e, KeyboardInterrupt) else "a trainer rank failed"
            self.log(f"{why}: discarded {n} in-flight sample(s) of coming steps; writing the checkpoint of step "
                     f"{self.step_done}")
            self.save_checkpoint()
            raise
        finally:
            if bar is not None:
                bar.close()
            plot_rewards(self.history_all() or self.history, os.path.join(self.out_dir, "reward_curve.png"),
                         model=tracking.model_name(self.config), algorithm=self.algorithm.title)
        return self.history

    def _run(self, last: int, bar, on_step: Optional[Callable[[dict], None]]) -> None:
        """`train`'s steps: the evaluation before (a fresh run), every step with its checkpoints and validations, the
        evaluation after and the last checkpoint."""
        earlier = self.history_all() or self.history
        check = LearningSignalCheck.for_config(self.config, self.log, earlier)
        self.signal_window = SignalWindow(self.tc.signal_check.grad_cos_window, earlier)  # a resumed run's too
        self.component_window = ComponentWindow(earlier)
        if self.step_done == 0 and self.resume is None:
            self.validate("before")
        while self.step_done < last:
            with self.memory.naming_oom():  # which stage ran out of device memory, and what to change
                m = self.step(self.step_done + 1)
            if bar is not None:
                bar.update(1)
                bar.set_postfix(reward=f"{m['reward_mean']:.3f}", dev=m["ratio_max_abs_dev"])
            if on_step is not None:
                on_step(m)
            check.observe(m)  # warns when the batches lose their learning signal; stops (raises) without any
            if self.tc.checkpoint_every and self.step_done % self.tc.checkpoint_every == 0:
                self.save_checkpoint()
            if self.tc.val_every and self.step_done % self.tc.val_every == 0 and self.step_done < last:
                self.validate(f"step{self.step_done:06d}")
        self.validate("after")
        self.save_checkpoint()

    def step(self, step: int) -> dict:
        """One training step, top to bottom: rollout, versions, update, sync, report. Returns its record."""
        tc, K = self.tc, self.tc.max_staleness
        # 1. Rollout: this step's batch (the next ones the staleness budget allows start now, behind it).
        t0 = time.time()
        self.pipeline.submit(step)
        for b in range(step + 1, min(step + K, self._last) + 1):
            self.pipeline.submit(b)
        out = self.pipeline.take(step)
        t_back = time.time()
        span = self.pipeline.span(step) or (t0, t_back)
        finished = [m.get("generate_finished_at") or span[1] for m in out.meta_info.get("metrics", [])]
        # 2. Versions: the samples that may train (none ahead of the trainer, none staler than K), as the algorithm's
        #    rows and advantages on the trainer's device (the driver's is the CPU when ranks train).
        out, versions, stale = self._fresh(step, out)
        self.memory.add_replicas(self.replicas)  # the rollout's peak memory, in the replicas' processes
        rewards = out.batch["rm_scores"][:, 0].float()
        uids = list(out.non_tensor_batch["uid"])
        adv = self.algorithm.advantages(rewards, uids, out)  # reward.aggregation gdpo reads out's components
        adv = self.controls.advantages(adv, out, uids)  # GARDO's diversity bonus, when on
        traj = self.algorithm.rows(out, self.policy.adapter)  # TrajectoryBatch, or CleanBatch (forward process)
        traj, advantages = traj.to(self.device), adv.advantages.to(self.device)
        if gradient_checkpointing(self.config) and not self._checkpointing:  # in the mode the rollout recorded
            from omniroll.train.recompute import enable_gradient_checkpointing

            enable_gradient_checkpointing(self.policy.denoiser, traj.execution)
            self._checkpointing = True
        # 3. Update: in this process (local_update.py) or on the ranks (parallel/distributed.py); colocated replicas
        #    sleep through it.
        sleep_s = self.colocation.sleep(self.replicas) if self.colocation is not None else None
        self.memory.begin()  # the recompute stage: the trainer's passes before its first optimizer update
        t1 = time.time()
        reads = tc.signal_every > 0 and (step - 1) % tc.signal_every == 0  # the meter reads this step
        plan = UpdatePlan(step=step, seed=tc.seed, micro_batch_size=tc.micro_batch_size,
                          per_update=tc.micro_batches_per_update, versions=versions, store=self.store,
                          halves=signal_halves(uids, tc.seed, step), signal=reads, groups=group_index(uids),
                          components=step_components(self.config, out, uids, self.device) if reads else None,
                          **self.controls.plan(step, out, rewards, traj, self.device))  # GARDO's gate, DDRL's term
        with self.interrupts.critical():  # a Ctrl-C from here lands after this step is logged
            res = self.updater.update(traj, advantages, uids, plan)  # the policy holds the trained weights after it
            self.memory.add("update", res.peak_bytes)
            t2 = time.time()
            # 4. Sync: the new weights to the replicas (woken first when colocated).
            wake_s = self.colocation.wake(self.replicas) if self.colocation is not None else None
            prox_version = self.version
            self.store.record(step)
            self._sync(step)
            self.memory.end("sync")
            self.step_done = step
            t3 = time.time()
            # 5. Report: the step's record (report/step_record.py), the step line, metrics.jsonl, the trackers.
            stats = res.stats
            signal = {**self.signal_window.metrics(signal_metrics(stats.grad_cos, stats.signal_rows_a,
                                                                  stats.signal_rows_b)),
                      **self.component_window.metrics(stats.component_cos)}
            clock = StepClock(t0=t0, back=t_back, rollout=span, last_generated=max(finished) if finished else span[1],
                              t1=t1, t2=t2, t3=t3, busy=self.pipeline.busy(t0, t3))
            m = step_record(step, rewards, adv, res, signal, versions, synced_version=self.version,
                            prox_version=prox_version, max_staleness=K, partial_rollout=tc.partial_rollout,
                            stale=stale, clock=clock, sleep_s=sleep_s, wake_s=wake_s, memory=self.memory.metrics())
            m.update(self.held_out.step_metrics() if self.held_out is not None else {})  # its warning, if any
            m.update(self.controls.metrics(plan, stats))
            self.pipeline.forget_before(t0)
            self.history.append(m)
            self.tracker.log_step(m, out, total=self._last)  # trainer.logger
        return m

    def _fresh(self, step: int, out: DataBatch) -> tuple[DataBatch, torch.Tensor, dict]:
        """The batch's samples that may train (`versions.trainable_rows`; `on_stale: wait` regenerates the batch)."""
        return trainable_rows(step, out, self.version, self.tc.max_staleness, self.tc.on_stale,
                              lambda: asyncio.run(self._rollout(step)), self.log)

    async def _rollout(self, step: int) -> DataBatch:
        batch = step_prompt_batch(self.prompts, self.config.n, self.tc.prompts_per_step, self.tc.seed, step,
                                  self.config.seed or 0, self.algorithm.sampling_overrides(step))
        return await self.manager.generate_sequences_async(batch)

    def _sync(self, version: int) -> None:
        """Push `version`'s weights (the store's copy) to every replica (train/weight_push.py). THE place where the
        in-flight policy is chosen: partial_rollout true lands the update between two denoise steps of in-flight
        samples (they continue with it); false holds the pipeline and waits for in-flight samples, so no sample spans
        two versions. Any failure names the version."""
        partial = self.tc.partial_rollout
        policy = {"partial": True} if partial else {"wait_for_inflight": True}
        hold = contextlib.nullcontext() if partial else self.pipeline.held()
        try:
            with hold, self.store.weights(version), self.algorithm.sampling_weights(self.policy):
                self.push.send(self.policy.weights_to_send(), version=version, **policy)
        except WeightPushError as e:
            raise WeightVersionError(str(e)) from e
        except Exception as e:
            raise WeightVersionError(f"weight sync to version {version} failed: {type(e).__name__}: {e}") from e
        self.version = version

    # ------------------------------------------------------------------ validation and checkpoints
    def validate(self, tag: str) -> dict:
        """The validation grid, validation.jsonl, the trackers and one line (`train/report/validation.py`); with
        `trainer.evaluation`, the task evaluation too (`train/report/task_eval.py`)."""
        sampling, cfg_scale = validation_guidance(self.config, self.algorithm)  # the regime it trains
        rec = run_validation(self.manager, self.val_prompts, self.config.val_kwargs.n, self.out_dir, tag,
                             self.step_done, self.tracker, self.log, sampling, cfg_scale, self.held_out)
        if self.task_eval is not None:
            rec.update(self.task_eval.run(self.manager, self.tracker, tag, self.step_done, self.replicas))
        return rec

    def save_checkpoint(self) -> str:
        optimizer, files = self.updater.optimizer_state(self.step_done)  # this process's, or the ranks' files
        return checkpoint.write_checkpoint(self.out_dir, self.step_done, policy=self.policy, store=self.store,
                                           state=checkpoint.run_state(self, optimizer), files=files)

    def history_all(self) -> list[dict]:
        """Every step's metrics in this out_dir (a resumed run appends to them)."""
        return tracking.step_records(self.out_dir)


#: the trainer's name from when it ran Flow-GRPO only, kept so that existing code keeps working
FlowGRPOTrainer = Trainer
