"""No call hangs: shut-down engines refuse at once, control calls time out naming themselves, sleep levels compose,
and a script that never calls shutdown() exits cleanly (tiny SD3, CPU)."""

import asyncio
import itertools
import os
import subprocess
import sys
import textwrap
import threading

import pytest
import torch

import omniroll
from omniroll import GenerationRequest, SamplingParams
from omniroll.engine.engine import DiffusionEngine
from omniroll.engine.errors import EngineAsleepError, EngineShutdownError
from omniroll.weights import OmniTensorLoRARequest, WeightManifest

PARAMS = SamplingParams(height=64, width=64, num_inference_steps=3, max_sequence_length=16)


def req(rid="r", seed=1):
    return GenerationRequest(request_id=rid, prompt="a red car", seed=seed, sampling_params=PARAMS)


def test_every_call_on_a_shut_down_engine_raises_at_once_naming_the_state(tiny_sd3_path):
    eng = DiffusionEngine.from_pretrained(tiny_sd3_path)
    eng.generate([req()])
    eng.shutdown()
    eng.shutdown()  # idempotent
    calls = {
        "abort": lambda: eng.abort("r"),
        "abort_all": eng.abort_all,
        "sleep": lambda: eng.sleep(level=1),
        "wake_up": eng.wake_up,
        "remove_lora": eng.remove_lora,
        "add_lora": lambda: eng.add_lora(OmniTensorLoRARequest("a", 1, lora_path="/nonexistent")),
        "update_weights_from_ipc": lambda: eng.update_weights_from_ipc(manifest=WeightManifest(), buckets=[],
                                                                       version=1),
        "generate": lambda: eng.generate([req()]),
        "call_between_steps": lambda: eng.call_between_steps(lambda: None),
    }
    for name, call in calls.items():
        with pytest.raises(EngineShutdownError, match="shut down") as e:
            call()
        assert str(e.value).startswith(name), str(e.value)
    assert eng.stats()["shut_down"]


def test_control_calls_time_out_naming_the_operation_and_never_run_late(tiny_sd3_path):
    eng = DiffusionEngine.from_pretrained(tiny_sd3_path)
    started, release = threading.Event(), threading.Event()

    def busy():  # occupies the engine thread, as a long step would
        started.set()
        release.wait(60)

    blocker = threading.Thread(target=eng.call_between_steps, args=(busy,))
    blocker.start()
    started.wait(60)
    ran = []
    with pytest.raises(TimeoutError, match="abort did not start within 0.2s"):
        eng.abort("x", timeout_s=0.2)
    with pytest.raises(TimeoutError, match=r"wake_up did not start within 0\.\d+s .*it will never run, nothing "
                                           r"changed"):
        eng.wake_up(timeout_s=0.2)
    with pytest.raises(TimeoutError, match="probe did not start"):
        eng.call_between_steps(lambda: ran.append(1), timeout_s=0.2, op="probe")
    release.set()
    blocker.join()
    assert eng.call_between_steps(lambda: "after") == "after" and ran == []  # the timed-out call was dropped
    # a call that started and outlives its timeout (a wake-up stuck in a device copy) says so, and completes after
    release.clear()
    with pytest.raises(TimeoutError, match="slow did not finish within 0.2s and is still running on the engine "
                                           "thread: it cannot be stopped halfway and will complete"):
        eng.call_between_steps(lambda: (release.wait(60), ran.append(2)), timeout_s=0.2, op="slow")
    release.set()
    assert eng.call_between_steps(lambda: list(ran)) == [2]
    with pytest.raises(ValueError, match="timeout_s"):
        eng.abort("x", timeout_s=None)
    eng.shutdown()


def test_cancelled_generate_async_aborts_its_request_without_blocking_the_event_loop(tiny_sd3_path):
    eng = DiffusionEngine.from_pretrained(tiny_sd3_path)
    long = GenerationRequest(request_id="long", prompt="a red car", seed=1,
                             sampling_params=PARAMS.model_copy(update={"num_inference_steps": 500}))
    started, release = threading.Event(), threading.Event()

    def busy():  # holds the engine thread: the abort cannot finish before `release`
        started.set()
        release.wait(60)

    async def run():
        task = asyncio.create_task(eng.generate_async(long))
        while eng.stats()["steps"] == 0:
            await asyncio.sleep(0.01)
        blocker = threading.Thread(target=eng.call_between_steps, args=(busy,))
        blocker.start()
        await asyncio.to_thread(started.wait, 60)
        task.cancel()

        async def releaser():  # runs only if the pending abort leaves the event loop free
            await asyncio.sleep(0.05)
            release.set()

        asyncio.create_task(releaser())
        with pytest.raises(asyncio.CancelledError):
            await task
        blocker.join()

    asyncio.run(run())
    assert eng.stats()["running"] == 0 and eng.stats()["waiting"] == 0  # aborted, not left running
    eng.shutdown()


def test_sleep_and_wake_compose_in_any_order(tiny_sd3_path):
    eng = DiffusionEngine.from_pretrained(tiny_sd3_path)
    weights = {k: v.clone() for k, v in eng.adapter.denoiser.state_dict().items()}
    ref = eng.generate([req()])[0]
    ops = {"sleep1": lambda: eng.sleep(level=1), "sleep2": lambda: eng.sleep(level=2), "wake": eng.wake_up}
    for seq in itertools.product(ops, repeat=3):
        deepest = 0
        for op in seq:
            result = ops[op]()
            deepest = 0 if op == "wake" else max(deepest, int(op[-1]))
            assert eng.asleep_level == deepest, seq
            assert op == "wake" or result["level"] == deepest
        eng.wake_up()
        if eng.stats()["weights_unusable"]:  # some level-2 sleep dropped the weights: refused until a full update
            with pytest.raises(EngineAsleepError, match="full weight sync"):
                eng.generate([req()])
            eng.update_weights_from_ipc(manifest=WeightManifest.from_named_tensors(weights.items()),
                                        buckets=_buckets(weights), version=eng.weight_version + 1)
        out = eng.generate([req()])[0]
        assert torch.equal(out.diffusion_output, ref.diffusion_output), seq
    eng.shutdown()


def _buckets(weights):
    from omniroll.weights import pack_buckets

    return pack_buckets(list(weights.items()), 1 << 20)


EXITS_MID_STEP = textwrap.dedent("""
    import sys, threading, time
    from omniroll import DiffusionEngine, GenerationRequest, SamplingParams
    engine = DiffusionEngine.from_pretrained(sys.argv[1])
    params = SamplingParams(height=64, width=64, num_inference_steps=500, max_sequence_length=16)
    requests = [GenerationRequest(request_id=f"r{i}", prompt="a red car", seed=i, sampling_params=params)
                for i in range(4)]
    threading.Thread(target=lambda: engine.generate(requests), daemon=True).start()
    while engine.stats()["steps"] < 2:  # the engine thread is inside its denoising steps
        time.sleep(0.01)
    print("exiting without shutdown()")
""")


@pytest.mark.slow  # slow: a script in a subprocess
def test_script_that_never_calls_shutdown_exits_cleanly(tiny_sd3_path):
    root = os.path.dirname(os.path.dirname(omniroll.__file__))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}
    for _ in range(3):
        proc = subprocess.run([sys.executable, "-c", EXITS_MID_STEP, tiny_sd3_path], capture_output=True, text=True,
                              env=env, timeout=300)
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert "terminate called" not in proc.stderr and "exiting without shutdown()" in proc.stdout
