"""`DiffusionAgentLoopWorker`: runs each row of a batch (planned by `rows.plan_rows`: uid, group index, seed, request
id, sampling parameters) as its own asyncio task in its agent loop, streams finished samples to reward workers, and
stacks the results (`output_batch.assemble`).

Failures: a row that fails (bad input, generation failed after the client's retries, reward status "failed") never
disappears: by default the worker raises ONE `AgentLoopError` listing every failed row and carrying the rows that
succeeded (`error.batch`, assembled as usual, and `error.succeeded_rows`), so a caller can keep them; with
`agent.on_failure: mark` it returns the batch with those rows marked (status "failed", zero tensors, `failed` mask,
`error` column). Rows whose override cannot share the output batch (`rows.rows_that_cannot_share`) are refused before
anything is generated: in raise mode the whole call fails at once, naming each such row and field; in mark mode only
they are marked failed.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, Optional

from omniroll.agent_loop.batch import DataBatch, to_object_array
from omniroll.agent_loop.loop import prompt_text
from omniroll.agent_loop.output_batch import RowResult, assemble, fit_error
from omniroll.config.agent_loops import get_agent_loop_class
from omniroll.agent_loop.rows import RowPlan, as_config, failed_entries, plan_batch, plan_rows, row_sampling


class AgentLoopError(RuntimeError):
    """One or more rows failed. `failed_rows`: [{"row", "uid", "request_id", "error"}, ...]; `batch`: the rows that
    succeeded, assembled like a normal output (a DataBatch in input order; None when none did); `succeeded_rows`:
    their row numbers in the input batch. All three survive pickling (e.g. across Ray)."""

    def __init__(self, message: str, failed_rows: Optional[list] = None, batch: Optional[DataBatch] = None,
                 succeeded_rows: Optional[list[int]] = None):
        super().__init__(message, failed_rows or [], batch, list(succeeded_rows or []))
        self.message, self.failed_rows = message, failed_rows or []
        self.batch, self.succeeded_rows = batch, list(succeeded_rows or [])

    def __str__(self) -> str:
        return self.message

    @classmethod
    def from_rows(cls, failed_rows: list[dict], total: int, batch: Optional[DataBatch] = None,
                  succeeded_rows: Optional[list[int]] = None, note: str = "") -> "AgentLoopError":
        lines = "\n".join(f"  row {f['row']} (uid={f['uid']!r}, request_id={f['request_id']!r}): {f['error']}"
                          for f in failed_rows)
        kept = (f"\n{len(batch)} row(s) succeeded: AgentLoopError.batch holds them (rows {succeeded_rows})"
                if batch is not None and len(batch) else "")
        return cls(f"{len(failed_rows)} of {total} rows failed{note}:\n{lines}{kept}", failed_rows, batch,
                   succeeded_rows)


def refuse_unshareable(plan: RowPlan, on_failure: str) -> None:
    """With `agent.on_failure: raise`, a batch holding rows that cannot share its output batch fails whole, before
    anything generates (AgentLoopError naming each row and field); with `mark` those rows are marked failed."""
    if plan.rejected and on_failure == "raise":
        raise AgentLoopError.from_rows(failed_entries(plan.rows, plan.rejected), len(plan.rows),
                                       note=" before generation (nothing was generated)")


class DiffusionAgentLoopWorker:
    """Diffusion agent loop worker: takes a batch of prompts and runs each row in an agent loop.

    config: the whole config (OmniRollConfig, dict or DictConfig). llm_client: a `RolloutClient` (or a list of replica
    handles, wrapped in one). teacher_client: unused (kept for verl's signature). reward_loop_worker_handles: reward
    workers (Ray handles or in-process `RewardLoopWorker`s) for streaming scoring.
    """

    def __init__(self, config: Any, llm_client: Any, teacher_client: Optional[dict] = None,
                 reward_loop_worker_handles: Optional[list] = None):
        self.config = as_config(config)
        if isinstance(llm_client, (list, tuple)):
            from omniroll.rollout.client import RolloutClient

            llm_client = RolloutClient(llm_client, timeout_s=self.config.timeout_s,
                                       max_retries=self.config.max_retries)
        self.client = llm_client
        self.teacher_client = teacher_client
        self.reward_pool = None
        if reward_loop_worker_handles:
            from omniroll.reward import RewardWorkerPool

            self.reward_pool = RewardWorkerPool(reward_loop_worker_handles)
        self._loops: dict[str, Any] = {}

    def _agent_loop(self, name: str) -> Any:
        loop = self._loops.get(name)
        if loop is None:  # built once per worker per agent name, never per sample
            cls = get_agent_loop_class(name)
            loop = cls(trainer_config=self.config, server_manager=self.client, tokenizer=None, processor=None,
                       dataset_cls=None, data_config=None)
            self._loops[name] = loop
        return loop

    def plan(self, batch: DataBatch) -> list[dict]:
        """Each row's fields (`rows.plan_rows`); a subclass may re-seed them (verl's worker does)."""
        return plan_rows(self.config, batch)

    async def generate_sequences(self, batch: DataBatch) -> DataBatch:
        """Generate one sample per row. Returns the output batch described in `output_batch.py` (`assemble`). Plans
        the batch and refuses it (`refuse_unshareable`) first: the entry point of a worker called directly (verl's
        manager); omniroll's manager plans the whole batch once and calls `generate_planned`."""
        plan = plan_batch(self.config, batch, self.plan(batch))
        refuse_unshareable(plan, self.config.agent.on_failure)
        return await self.generate_planned(batch, plan)

    async def generate_planned(self, batch: DataBatch, plan: RowPlan, rerun: int = 0) -> DataBatch:
        """Generate one sample per row of `batch`, planned (and refused) by the caller. `rerun` > 0: the manager runs
        again the chunk of a worker it lost (see manager.py); its engine requests get new ids."""
        t0 = time.perf_counter()
        rows, mark = plan.rows, self.config.agent.on_failure == "mark"
        tasks = {i: asyncio.create_task(self._run_row(i, f, plan.base_sampling, plan.validate, rerun))
                 for i, f in enumerate(rows) if i not in plan.rejected}
        reran: set[int] = set()  # rows whose tree ran again whole (it straddled a weight update)
        try:
            done = dict(zip(tasks, await asyncio.gather(*tasks.values())))
            if self.config.algo.tree is not None and not plan.validate:
                reran = await self._one_version_per_tree(done, plan, rerun)
        except BaseException:
            for t in tasks.values():
                t.cancel()
            raise
        results: list[RowResult] = [
            done[i] if i in done else RowResult(index=i, request_id=f["request_id"], seed=f["seed"],
                                                error=plan.rejected[i])
            for i, f in enumerate(rows)]
        failed = {r.index: r.error for r in results if r.status == "failed"}
        if failed and not mark:
            ok = [r for r in results if r.status != "failed"]
            partial = (self._assemble(ok, batch[[r.index for r in ok]], [rows[r.index] for r in ok], False, reran)
                       if ok else None)
            raise AgentLoopError.from_rows(failed_entries(rows, failed), len(results), batch=partial,
                                           succeeded_rows=[r.index for r in ok])
        out = self._assemble(results, batch, rows, mark, reran)
        out.meta_info["worker_seconds"] = time.perf_counter() - t0
        return out

    async def _one_version_per_tree(self, done: dict, plan: RowPlan, rerun: int) -> set[int]:
        """A tree's leaves run on one weight version: a tree whose leaves recorded different versions (a weight update
        landed between their admissions on the replica; `trees_on_several_versions`) runs again whole, once (request
        ids `~tree1`: the same seeds, the same samples on one version); one that straddles again fails each of its
        rows, naming the versions. `done` (row index -> RowResult) is updated in place; returns the rows run again."""
        again: list[int] = []
        for attempt in (1, 2):
            straddling = trees_on_several_versions(done, plan.rows)
            if not straddling:
                return set(again)
            if attempt == 2:
                for uid, (rows, versions) in straddling.items():
                    for i in rows:
                        done[i] = RowResult(index=i, request_id=plan.rows[i]["request_id"], seed=plan.rows[i]["seed"],
                                            error=f"tree rollout: the leaves of uid {uid!r} ran on different weight "
                                                  f"versions ({versions}) twice; a tree runs on one version")
                return set(again)
            again = [i for rows, _ in straddling.values() for i in rows]
            results = await asyncio.gather(*[self._run_row(i, plan.rows[i], plan.base_sampling, plan.validate, rerun,
                                                           suffix="~tree1") for i in again])
            done.update(zip(again, results))
        return set(again)

    def _assemble(self, results: list[RowResult], inputs: DataBatch, rows: list[dict], mark: bool,
                  reran: set[int] = frozenset()) -> DataBatch:
        """`assemble` on the inputs with their planned uid and group index (a direct caller may have left them out);
        a tree rollout's rows also carry `tree_path` and `tree_rerun` (whether the row's tree ran again whole, in
        `reran`: its first run straddled a weight update)."""
        nt = {**inputs.non_tensor_batch, "uid": to_object_array(f["uid"] for f in rows),
              "_group_index": to_object_array(f["_group_index"] for f in rows)}
        if any("tree_path" in f for f in rows):  # a tree rollout: each row's node path, so siblings can be found
            nt["tree_path"] = to_object_array(f.get("tree_path") for f in rows)
            nt["tree_rerun"] = to_object_array(r.index in reran for r in results)
        return assemble(results, DataBatch(inputs.batch, nt, inputs.meta_info, len(inputs)),
                        prompt_length=self.config.prompt_length,
                        max_prompt_embed_length=self.config.max_prompt_embed_length, mark_failed=mark,
                        scored=self.reward_pool is not None)

    async def _run_row(self, i: int, fields: dict, base_sp: dict, validate: bool, rerun: int = 0,
                       suffix: str = "") -> RowResult:
        res = RowResult(index=i, request_id=fields["request_id"], seed=fields["seed"])
        try:
            base = {**base_sp, **{k: fields[k] for k in ("latent_seed", "noise_seeds") if fields.get(k) is not None}}
            sp = row_sampling(base, fields.get("sampling_params"), validate)
            loop = self._agent_loop(fields.get("agent_name") or self.config.agent.default_agent_loop)
            row_kwargs = {k: v for k, v in fields.items() if k != "sampling_params"}
            if rerun:  # the lost worker's requests may still run on the replicas under the row's own id
                row_kwargs["request_id"] = f"{fields['request_id']}~rerun{rerun}"
            row_kwargs["request_id"] = f"{row_kwargs['request_id']}{suffix}"
            out = await loop.run(sp, **row_kwargs)
            err = fit_error(out, self.config.prompt_length, self.config.max_prompt_embed_length)
            if err is not None:
                raise ValueError(err)
        except Exception as e:  # this row fails; the others carry on
            res.error = f"{type(e).__name__}: {e}"
            return res
        res.out = out
        if self.reward_pool is not None:
            await self._score(res, fields)
        return res

    async def _score(self, res: RowResult, fields: dict) -> None:
        from omniroll.reward import RewardSample

        out = res.out
        t0 = time.perf_counter()
        res.score_started_at = time.time()
        try:
            rm = fields.get("reward_model") or {}
            sample = RewardSample(
                sample_id=res.request_id, image=out.response_diffusion_output.numpy(),
                prompt=prompt_text(fields["raw_prompt"]), data_source=str(fields.get("data_source") or ""),
                ground_truth=rm.get("ground_truth") if isinstance(rm, dict) else None,
                extra_info=dict(fields.get("extra_info") or {}),
            )
            result = await self.reward_pool.score(sample)
        except Exception as e:  # never a silent 0: the row is failed with the reason
            res.error = f"reward: {type(e).__name__}: {e}"
        else:
            res.reward = result
            out.reward_score = result.score
            if result.status == "failed":
                res.error = f"reward failed: {result.error}"
        out.metrics.compute_score = time.perf_counter() - t0


def trees_on_several_versions(results: dict, rows: list[dict]) -> dict[str, tuple[list[int], list]]:
    """The prompt groups (trees, by uid) whose generated leaves ran on different weight versions: uid -> (their row
    indices in `results`, the distinct (weight_version, step_weight_versions) of their leaves)."""
    trees: dict[str, list[int]] = {}
    for i in results:
        trees.setdefault(rows[i]["uid"], []).append(i)
    out = {}
    for uid, idx in trees.items():
        versions = {(r.out.extra_fields.get("weight_version"), tuple(r.out.extra_fields.get("step_weight_versions")
                                                                     or ()))
                    for r in (results[i] for i in idx) if r.out is not None}
        if len(versions) > 1:
            out[uid] = (idx, sorted(versions))
    return out
