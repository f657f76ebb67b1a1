"""omniroll driven by verl's own classes on CPU (the optional `omniroll[verl]` extra; skipped without verl):
`LLMServerManager` (hybrid path, a stand-in worker group), `LLMServerClient`, `AgentLoopManager` with omniroll's
worker, verl's `RewardLoopWorker`, and `CheckpointEngineManager` sleep -> naive weight update -> wake."""

import asyncio
import uuid

import numpy as np
import pytest
import torch

verl = pytest.importorskip("verl")

from tests.verl_helpers import (N, PROMPTS, STEPS, W, StandInActor, StandInActorGroup,  # noqa: E402
                                StandInWorkerGroup, trainer_batch, verl_config)

PROMPT_5 = 'A Photo of the "OCR" text: Hello-World 42!'  # row 5's prompt (trainer_batch)


def test_verl_drives_omniroll(ray_cluster, tiny_sd3_path):
    ray = ray_cluster
    import omniroll.integrations.verl as ov
    from verl.checkpoint_engine.base import CheckpointEngineManager
    from verl.experimental.reward_loop.reward_loop import RewardLoopWorker
    from verl.utils.config import omega_conf_to_dataclass
    from verl.workers.rollout.llm_server import LLMServerManager

    from omniroll.models.sd3 import SD3Adapter

    cfg = verl_config(tiny_sd3_path)
    reward = ray.remote(RewardLoopWorker).options(num_cpus=0).remote(cfg, None)
    llm = LLMServerManager.create(cfg, worker_group=StandInWorkerGroup())
    agent = None
    try:
        (replica,) = llm.get_replicas()
        assert isinstance(replica, ov.OmnirollReplica) and llm.get_addresses()[0].startswith("omniroll_server_0_0@")
        client = llm.get_client()

        # Level A: vLLM-Omni's generate, with VeRL-Omni's sampling dict and SD3 token ids.
        adapter = SD3Adapter.from_pretrained(tiny_sd3_path)
        ids = adapter.tokenize("a red cat", 16)
        sampling = {"height": 64, "width": 64, "num_inference_steps": STEPS, "output_type": "image",
                    "true_cfg_scale": 1.0, "max_sequence_length": 16, "guidance_scale": 4.5, "num_frames": 1,
                    "noise_level": 0.7, "sde_type": "sde", "sde_window_size": W, "sde_window_range": None,
                    "sde_contiguous": True, "sample_strategy": "random", "logprobs": True, "global_steps": 1,
                    "seed": 5}
        out0 = asyncio.run(_generate(client, sampling, ids))
        assert out0.stop_reason == "completed" and out0.diffusion_output.dtype == torch.uint8
        assert out0.log_probs.dtype == torch.float32 and out0.log_probs.shape == (W,)
        ef = out0.extra_fields
        assert ef["global_steps"] == ef["min_global_steps"] == 0
        for key in ("all_latents", "all_timesteps", "prompt_embeds", "prompt_embeds_mask", "pooled_prompt_embeds",
                    "negative_prompt_embeds", "negative_prompt_embeds_mask", "negative_pooled_prompt_embeds"):
            assert isinstance(ef[key], torch.Tensor), key
        with pytest.raises(Exception, match="unknown key"):
            asyncio.run(_generate(client, {**sampling, "heigth": 64}, ids))

        # Level B: verl's AgentLoopManager with omniroll's worker, streaming rewards to verl's RewardLoopWorker.
        agent = ov.OmnirollAgentLoopManager.create(config=cfg, llm_client=client, reward_loop_worker_handles=[reward])
        out = agent.generate_sequences(trainer_batch(global_steps=1))
        B = N * PROMPTS
        assert out.batch["responses"].dtype == torch.uint8 and out.batch["responses"].shape == (B, 3, 64, 64)
        assert out.batch["rollout_log_probs"].dtype == torch.float32 and out.batch["rollout_log_probs"].shape == (B, W)
        assert out.batch["all_latents"].shape[:2] == (B, W + 1) and out.batch["prompts"].dtype == torch.int64
        assert out.batch["rm_scores"].shape == (B, 1) and out.batch["rm_scores"].dtype == torch.float32
        assert out.non_tensor_batch["__num_turns__"].dtype == np.int32
        assert list(out.non_tensor_batch["global_steps"]) == [0] * B
        # compute_score's extra fields are kept, as verl's reward loop keeps them
        assert "timing" in out.meta_info and out.meta_info["reward_extra_keys"] == ["brightness", "prompt_chars"]
        assert np.allclose(np.asarray(out.non_tensor_batch["brightness"], dtype=np.float64) / 255.0,
                           out.batch["rm_scores"][:, 0].double().numpy(), atol=1e-6)
        assert list(out.non_tensor_batch["prompt_chars"]) == [9] * N + [42] * N
        seeds = list(out.non_tensor_batch["seed"])
        # seeds follow VeRL-Omni's scheme (rollout seed, step, global row index), never the per-step uuid4 uid
        assert seeds == [((3 + 1 - 1) * 1_000_003 + g) % (2**63 - 1) for g in range(B)]
        fresh_uids = [str(uuid.uuid4()) for _ in range(PROMPTS)]  # VeRL-Omni's trainer: new uuid4s every step
        again = agent.generate_sequences(trainer_batch(global_steps=1, uids=fresh_uids))
        assert list(again.non_tensor_batch["seed"]) == seeds
        assert torch.equal(again.batch["responses"], out.batch["responses"])
        assert len(set(seeds)) == B  # no two rows of a group share a seed under verl's chunking
        worker = ov.OmnirollVerlWorker(cfg, llm_client=None)
        assert seeds == [r["seed"] for r in worker.plan(trainer_batch(global_steps=1))]  # = one worker's seeds
        for chunks in (2, 4, 8):
            assert [r["seed"] for part in trainer_batch(1).chunk(chunks) for r in worker.plan(part)] == seeds
        alone = asyncio.run(ov.VerlClient(client).generate(  # row 5 on its own: the same sample
            "alone", PROMPT_5, worker.config.sampling_params(), seeds[5]))
        assert torch.equal(alone.diffusion_output, out.batch["responses"][5])
        level_a = asyncio.run(client.generate(  # row 5 as VeRL-Omni's own worker asks for it: token ids, its seed
            "level-a", prompt_ids=[1, 2, 3], extra_prompt_ids=adapter.tokenize(PROMPT_5, 16),
            sampling_params={**worker.config.sampling_params(), "seed": seeds[5],
                             "sde_window_range": list(worker.config.algo.sde_window_range)}))
        assert torch.equal(level_a.diffusion_output, out.batch["responses"][5])

        # CheckpointEngineManager: sleep, naive update to step 2, wake; new weights change the same-seed image.
        actor = ray.remote(StandInActor).options(num_cpus=0).remote(cfg.actor_rollout_ref.rollout,
                                                                    cfg.actor_rollout_ref.model)
        g = torch.Generator().manual_seed(0)
        new_weights = {n: (p + 0.05 * torch.randn(p.shape, generator=g)).numpy()
                       for n, p in adapter.transformer.state_dict().items()}
        ray.get(actor.set_weights.remote(new_weights))
        ckpt = CheckpointEngineManager(omega_conf_to_dataclass(cfg.actor_rollout_ref.rollout.checkpoint_engine),
                                       StandInActorGroup(actor), llm.get_replicas())
        ckpt.sleep_replicas()
        ckpt.update_weights(global_steps=2)
        ckpt.wake_up_replicas()
        out2 = asyncio.run(_generate(client, sampling, ids))
        assert out2.extra_fields["global_steps"] == 2
        assert not torch.equal(out2.diffusion_output, out0.diffusion_output)
        after = agent.generate_sequences(trainer_batch(global_steps=2))
        for key in ("global_steps", "min_global_steps", "max_global_steps", "weight_version"):
            assert list(after.non_tensor_batch[key]) == [2] * B, key

        # A stream with a name the model does not have changes nothing (omniroll's update is transactional).
        weights = {n: (p + 1.0).numpy() for n, p in adapter.transformer.state_dict().items()}
        weights["transformer_blocks.0.no_such_weight"] = weights.pop(next(iter(weights)))
        ray.get(actor.set_weights.remote(weights))
        with pytest.raises(Exception, match="no_such_weight"):
            ckpt.update_weights(global_steps=3)
        out3 = asyncio.run(_generate(client, sampling, ids))
        assert out3.extra_fields["global_steps"] == 2 and torch.equal(out3.diffusion_output, out2.diffusion_output)

        # verl re-syncs the same step (after a colocated reward model slept the rollout): applied, still tagged 2.
        ray.get(actor.set_weights.remote(new_weights))
        ckpt.update_weights(global_steps=2)
        out4 = asyncio.run(_generate(client, sampling, ids))
        assert out4.extra_fields["global_steps"] == 2 and torch.equal(out4.diffusion_output, out2.diffusion_output)
    finally:
        handles = (getattr(agent, "agent_loop_workers", None) or []) + [reward, llm.global_load_balancer]
        for h in handles + list(llm.server_handles):
            ray.kill(h, no_restart=True)


async def _generate(client, sampling, ids):
    return await client.generate("req-0", prompt_ids=[1, 2, 3], sampling_params=sampling, extra_prompt_ids=ids)


def test_verl_omni_sampling_dict_is_mapped_with_unknown_keys_refused():
    from omniroll.integrations.verl import map_sampling_params

    fields, seed, dropped = map_sampling_params(
        {"height": 64, "width": 64, "num_inference_steps": 10, "output_type": "image", "guidance_scale": None,
         "true_cfg_scale": 1.0, "num_frames": 1, "noise_level": 1.0, "sde_type": "sde", "sde_window_size": 2,
         "sde_window_range": None, "sde_contiguous": True, "sample_strategy": "random", "logprobs": True,
         "global_steps": 7})
    assert fields["output_type"] == "pixel" and fields["guidance_scale"] == 0.0
    assert fields["sde_window_range"] == (0, 5) and seed is None  # VeRL-Omni's SD3 default range
    assert fields["num_frames"] == 1 and fields["true_cfg_scale"] == 1.0
    assert dropped == ["global_steps", "sample_strategy", "sde_contiguous"]
    for bad, message in (({"heigth": 64}, r"unknown key\(s\) \['heigth'\]"),
                         ({"sample_strategy": "progressive"}, "MixGRPO"),
                         ({"sde_contiguous": False}, "contiguous"),
                         ({"num_inference_steps": 0}, "num_inference_steps"),
                         ({"seed": -1}, r"seed must be an int in \[0, 2\*\*63\)")):
        with pytest.raises(ValueError, match=message):
            map_sampling_params(bad)


def test_verl_omni_rollout_config_becomes_omniroll_config(tiny_sd3_path):
    from omniroll.integrations.verl import omniroll_config_from_verl

    cfg = verl_config(tiny_sd3_path)
    r = cfg.actor_rollout_ref.rollout  # VeRL-Omni's DiffusionRolloutConfig sections
    r.pipeline = {"height": 128, "width": 128, "num_inference_steps": 8, "output_type": "image",
                  "guidance_scale": 4.5, "max_sequence_length": 32, "true_cfg_scale": 1.0}
    r.algo = {"noise_level": 0.8, "sde_type": "cps", "sde_window_size": 3, "sde_window_range": None}
    r.custom = {"omniroll": {"pipeline": {"height": 64}, "val_kwargs": {"seed_mode": "shared"}}}
    oc = omniroll_config_from_verl(cfg)
    assert (oc.pipeline.height, oc.pipeline.width, oc.pipeline.num_inference_steps) == (64, 128, 8)  # custom wins
    assert (oc.algo.sde_type, oc.algo.sde_window_range, oc.n, oc.seed) == ("cps", (0, 5), N, 3)
    assert oc.engine.model == tiny_sd3_path and oc.engine.dtype == "float32" and oc.val_kwargs.seed_mode == "shared"


def test_import_omniroll_never_imports_verl():
    import subprocess
    import sys

    code = "import sys, omniroll, omniroll.integrations; assert 'verl' not in sys.modules, 'verl was imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_server_rpc_surface_in_process(tiny_sd3_path):
    """vLLM-Omni's server calls on one OmnirollServer (no Ray): prompt forms, abort / resume, no-ops, refusals."""
    from omniroll.integrations.verl import OmnirollServer

    server = OmnirollServer(tiny_sd3_path, engine_kwargs={"max_batch_size": 4})
    ids = server.engine.adapter.tokenize("a red cat", 16)
    sp = {"height": 64, "width": 64, "num_inference_steps": 2, "max_sequence_length": 16, "guidance_scale": 4.5,
          "seed": 1}

    async def scenario():
        out = await server.generate([1], sp, "a", extra_prompt_ids=ids)
        assert out.stop_reason == "completed" and out.extra_fields["global_steps"] == 0
        for bad, message in (({}, "prompt_ids alone"), ({"image_data": [1]}, "text-to-image"),
                             ({"extra_prompt_ids": ids, "negative_prompt_ids": [3]}, "negative_prompt_ids alone")):
            with pytest.raises(ValueError, match=message):
                await server.generate([1], sp, "bad", **bad)
        slow = asyncio.create_task(server.generate([1], {**sp, "num_inference_steps": 200}, "slow", prompt="x"))
        while not server.engine.stats()["running"]:
            await asyncio.sleep(0.01)
        await server.abort_all_requests()
        assert (await slow).stop_reason == "aborted"
        held = asyncio.create_task(server.generate([1], sp, "held", extra_prompt_ids=ids))
        for _ in range(3):
            await asyncio.sleep(0)
        stats = server.engine.stats()
        assert not held.done() and stats["running"] == stats["waiting"] == 0  # held until resume_generation
        await server.resume_generation()
        assert torch.equal((await held).diffusion_output, out.diffusion_output)  # same seed, same sample
        await server.abort_all_requests(reject_request=True)
        with pytest.raises(RuntimeError, match="rejected"):
            await server.generate([1], sp, "rejected", extra_prompt_ids=ids)
        await server.resume_generation()
        assert len(server.engine.prompt_cache)
        await server.clear_kv_cache()
        assert not len(server.engine.prompt_cache)
        for noop in (server.release_kv_cache, server.resume_kv_cache, server.start_profile, server.stop_profile):
            assert await noop() is None
        await server.collective_rpc("sleep")
        assert server.engine.asleep_level == 1
        await server.wake_up(tags=["weights"])
        assert server.engine.asleep_level == 0
        with pytest.raises(NotImplementedError, match="collective_rpc"):
            await server.collective_rpc("load_model")

    try:
        asyncio.run(scenario())
    finally:
        server.engine.shutdown()


def test_verl_worker_refuses_a_chunk_without_a_global_index(tiny_sd3_path):
    from omniroll.integrations.verl import OmnirollVerlWorker

    batch = trainer_batch(global_steps=1)
    batch.non_tensor_batch.pop("_rollout_seed_global_idx")
    with pytest.raises(ValueError, match="_rollout_seed_global_idx"):
        asyncio.run(OmnirollVerlWorker(verl_config(tiny_sd3_path), llm_client=None).generate_sequences(batch[:4]))
