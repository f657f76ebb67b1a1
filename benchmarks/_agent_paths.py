"""The timed paths of benchmarks/agent_loop_overhead.py: (a) the engine direct, (b)/(b') the agent loop (Ray replica +
AgentLoopManager, optionally with streaming HTTP rewards), fed exactly the same requests."""

from __future__ import annotations

import time

import torch


def rows_for(prompts: list[str], n: int, run: int) -> list[dict]:
    """One dict per sample, in batch order (p0 x n, p1 x n, ...): uid, group index, prompt."""
    return [{"uid": f"run{run}-p{i}", "index": j, "prompt": p} for i, p in enumerate(prompts) for j in range(n)]


def make_batch(rows: list[dict], global_steps: int, rollout_seed: int):
    from omniroll.agent_loop import DataBatch

    return DataBatch.from_dict(non_tensors={
        "raw_prompt": [r["prompt"] for r in rows], "uid": [r["uid"] for r in rows],
        "data_source": ["bench"] * len(rows)}, meta_info={"global_steps": global_steps, "rollout_seed": rollout_seed})


def engine_requests(rows: list[dict], cfg, global_steps: int, rollout_seed: int) -> list:
    """Exactly the requests the agent loop sends for `make_batch(rows, ...)` (see DiffusionAgentLoopWorker.plan)."""
    from omniroll.engine.params import GenerationRequest, SamplingParams
    from omniroll.sampling.seeds import derive_seed

    sp = SamplingParams.model_validate(cfg.sampling_params())
    return [GenerationRequest(request_id=f"train/s{global_steps}/{r['uid']}/{r['index']}", prompt=r["prompt"],
                              negative_prompt=None, sampling_params=sp,
                              seed=derive_seed(rollout_seed, global_steps, r["uid"], r["index"]))
            for r in rows]


def engine_steps(engine) -> tuple[int, int]:
    s = engine.stats()
    return int(s["steps"]), int(round(s["mean_rows_per_step"] * s["steps"]))


def run_engine(engine, rows, cfg, step, args) -> dict:
    reqs = engine_requests(rows, cfg, step, args.seed)
    s0 = engine_steps(engine)
    t0 = time.perf_counter()
    outs = engine.generate(reqs)
    dt = time.perf_counter() - t0
    s1 = engine_steps(engine)
    assert len(outs) == len(reqs) and all(o.stop_reason == "completed" for o in outs)
    return {"seconds": dt, "forwards": s1[0] - s0[0], "rows": s1[1] - s0[1],
            "responses": torch.stack([o.diffusion_output for o in outs]),
            "log_probs": torch.stack([o.log_probs for o in outs])}


def run_agent_loop(manager, replica, rows, step, args, reward_server=None) -> dict:
    import ray

    batch = make_batch(rows, step, args.seed)
    if reward_server is not None:
        reward_server.reset()
    s0 = ray.get(replica.__ray_call__.remote(lambda self: engine_steps(self.engine)))
    t_wall0 = time.time()
    t0 = time.perf_counter()
    out = manager.generate_sequences(batch)
    dt = time.perf_counter() - t0
    t_wall1 = time.time()
    s1 = ray.get(replica.__ray_call__.remote(lambda self: engine_steps(self.engine)))
    nt = out.non_tensor_batch
    assert len(out) == len(rows) and list(nt["status"]) == ["ok"] * len(rows), set(nt["status"])
    metrics = out.meta_info["metrics"]
    finished = [m["generate_finished_at"] for m in metrics]
    submitted = [m["generate_finished_at"] - m["client_seconds"] for m in metrics]
    res = {"seconds": dt, "forwards": s1[0] - s0[0], "rows": s1[1] - s0[1],
           "responses": out.batch["responses"], "log_probs": out.batch["rollout_log_probs"],
           # head: call -> first request sent by a worker; span: first sent -> last sample back in its worker;
           # tail: last sample back -> the driver holds the merged batch (assemble, Ray transfer, merge)
           "head": min(submitted) - t_wall0, "span": max(finished) - min(submitted), "tail": t_wall1 - max(finished)}
    if reward_server is not None:
        rm = out.batch["rm_scores"]
        assert rm.shape == (len(rows), 1) and torch.isfinite(rm).all()
        infos = nt["reward_extra_info"]
        last_reward = max(i["finished_at"] for i in infos)
        res.update(reward_requests=reward_server.requests, reward_batch_sizes=list(reward_server.batch_sizes),
                   reward_wait=reward_server.requests * args.reward_latency,
                   reward_after_last_sample=last_reward - max(finished),
                   first_reward_started_before_last_sample=max(finished) - min(i["started_at"] for i in infos))
    return res
