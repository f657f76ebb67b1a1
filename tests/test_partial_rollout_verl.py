"""Partial rollouts through the verl bridge (skipped without verl): a sample that a partial weight update reached
mid-denoise carries VeRL-Omni's `min_global_steps` / `max_global_steps` (and `step_global_steps`), mapped through the
server's `set_global_steps`, in its extra_fields and in the DataProto columns."""

import asyncio

import pytest
import torch

verl = pytest.importorskip("verl")

from omniroll.trajectory_file import batch_from_outputs  # noqa: E402
from omniroll.weights import WeightSender  # noqa: E402


def test_min_and_max_global_steps_of_a_sample_that_spans_a_partial_update(tiny_sd3_path):
    from omniroll.integrations.verl import OmnirollServer
    from omniroll.integrations.verl.agent_loop import VerlClient, to_dataproto

    server = OmnirollServer(tiny_sd3_path, engine_kwargs={"max_batch_size": 4})
    engine = server.engine
    sp = {"height": 32, "width": 32, "num_inference_steps": 4, "max_sequence_length": 8, "guidance_scale": 4.5,
          "noise_level": 0.8, "sde_type": "sde", "sde_window_size": 2, "sde_window_range": [1, 3], "logprobs": True,
          "seed": 3}

    class Client:  # verl's LLMServerClient.generate, in process
        async def generate(self, request_id, prompt_ids, sampling_params, **kw):
            return await server.generate(prompt_ids, sampling_params, request_id, **kw)

    async def scenario():
        await server.set_global_steps(10)  # engine version 0 is the trainer's step 10
        engine.pause_generation(after_steps=2)
        task = asyncio.create_task(VerlClient(Client()).generate("s", "a red cat", sp, seed=3))
        await asyncio.to_thread(engine.wait_for_pause)
        weights = {k: v * 1.01 for k, v in engine.adapter.denoiser.state_dict().items()}
        ack = await asyncio.to_thread(WeightSender([engine]).send, weights, 1, partial=True)
        assert ack[0]["continued"] == ["s"]
        await server.set_global_steps(11)  # version 1 is step 11
        engine.resume_generation()
        return await task

    try:
        out = asyncio.run(scenario())
    finally:
        engine.shutdown()
    ef = out.extra_fields
    assert ef["step_indices"].tolist() == [1, 2]
    assert (ef["engine_weight_version"], ef["global_steps"], ef["weight_version"]) == (0, 10, 10)
    assert (ef["min_global_steps"], ef["max_global_steps"], ef["step_global_steps"]) == (10, 11, [10, 11])
    assert (ef["min_weight_version"], ef["max_weight_version"], ef["step_weight_versions"]) == (10, 11, [10, 11])
    proto = to_dataproto(batch_from_outputs([out], ["a red cat"], 1))
    nt = proto.non_tensor_batch
    assert (list(nt["global_steps"]), list(nt["min_global_steps"]), list(nt["max_global_steps"])) == ([10], [10],
                                                                                                       [11])
    assert list(nt["step_weight_versions"]) == [[10, 11]]
    assert isinstance(out.log_probs, torch.Tensor) and out.log_probs.shape == (2,)
