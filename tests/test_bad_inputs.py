"""Every bad input is refused before anything starts, as the project's own one-line error naming the key, row or
path: config keys (at load time, before Ray), agent-loop batch fields (before any row generates), engine requests
(refused, never coerced), and a disk that fills while a command writes its outputs."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
from pydantic import ValidationError

from omniroll.config import ConfigError, load_config


# --------------------------------------------------------------------------------------------------- config
def _config_error(raw: dict) -> str:
    with pytest.raises(ConfigError) as e:
        load_config(raw)
    msg = str(e.value)
    assert "\n" not in msg and "pydantic.dev" not in msg and "Traceback" not in msg
    return msg


@pytest.mark.parametrize("raw, expected", [
    ({"pipeline": {"height": 100}}, "pipeline.height: must be a positive multiple of 16"),
    ({"val_kwargs": {"pipeline": {"width": 72}}}, "val_kwargs.pipeline.width: must be a positive multiple of 16"),
    ({"reward": {"functions": {"mine": {"fn": "no_such_module_xyz:score"}}}},
     "reward.functions.mine.fn: reward function 'no_such_module_xyz:score': module 'no_such_module_xyz' not found"),
    ({"reward": {"functions": {"remote": {"fn": "http"}}}},
     "reward.functions.remote.kwargs: missing a required argument: 'url'"),
    ({"engine": {"kwargs": {"prefix_sharin": False}}}, "engine.kwargs: unknown key(s) ['prefix_sharin']"),
    ({"engine": {"kwargs": {"decode_batch_size": 0}}}, "engine.kwargs: decode_batch_size must be >= 1"),
    ({"replicas": {"num_cpus": float("inf")}}, "replicas.num_cpus: Input should be a finite number"),
    ({"replicas": {"num_gpus": float("nan")}}, "replicas.num_gpus: Input should be a finite number"),
    ({"engine": {"max_waiting": 0}}, "engine.max_waiting: Input should be greater than or equal to 1"),
    # (loops other tests registered follow the built-in one)
    ({"agent": {"default_agent_loop": "nope"}}, "agent.default_agent_loop: agent loop 'nope' is not registered, the "
                                                "registered ones are ['diffusion_single_turn_agent'"),
])
def test_config_refuses_at_load_time_naming_the_key(raw, expected):
    assert expected in _config_error(raw)


def test_validating_a_config_builds_no_model(tmp_path, monkeypatch):
    monkeypatch.setenv("OMNIROLL_CACHE", str(tmp_path / "cache"))
    for model in ("tiny", "tiny-flux", "tiny-wan"):
        assert "must be a positive multiple" in _config_error({"engine": {"model": model},
                                                               "pipeline": {"height": 90}})
        load_config({"engine": {"model": model}})
    assert not (tmp_path / "cache").exists()


def test_config_refuses_a_model_path_that_does_not_exist(tmp_path):
    missing = str(tmp_path / "no-such-checkpoint")
    msg = _config_error({"engine": {"model": missing}})
    assert msg.startswith("invalid config: engine.model: ") and missing in msg
    msg = _config_error({"engine": {"model": str(tmp_path)}})  # a directory, but not a diffusers checkpoint
    assert "engine.model: " in msg and "model_index.json" in msg


def test_reward_module_that_fails_to_import_names_the_function(tmp_path, monkeypatch):
    (tmp_path / "broken_reward_mod.py").write_text("import no_such_dependency_xyz\n\ndef score(s):\n    return []\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    msg = _config_error({"reward": {"functions": {"b": {"fn": "broken_reward_mod:score"}}}})
    assert "reward.functions.b.fn: " in msg and "importing 'broken_reward_mod' failed" in msg


def test_several_problems_are_one_line_each_in_the_cli(tiny_sd3_path, monkeypatch, capsys, tmp_path):
    from omniroll.cli import main

    monkeypatch.setattr("omniroll.models.resolve_model", lambda model, cache_dir=None: tiny_sd3_path)
    rc = main(["generate", "--prompt", "x", "--out", str(tmp_path), "--height", "100",
               "--override", "reward.functions.r.fn=http", "--override", "replicas.num_cpus=.inf"])
    assert rc == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 3, lines
    assert any("--height (pipeline.height): must be a positive multiple of 16" in x for x in lines)
    assert any("reward.functions.r.kwargs: missing a required argument: 'url'" in x for x in lines)
    assert any("replicas.num_cpus: Input should be a finite number" in x for x in lines)


# ---------------------------------------------------------------------------------------------- agent-loop batch
def _batch(meta=None, **columns):
    from omniroll.agent_loop.batch import DataBatch

    nt = {"raw_prompt": ["a", "a"], "uid": ["u", "u"], **columns}
    return DataBatch.from_dict(non_tensors=nt, meta_info={"global_steps": 0, **(meta or {})})


@pytest.mark.parametrize("meta, columns, expected", [
    ({"global_steps": "3"}, {}, "meta_info['global_steps'] must be an int >= 0, got '3'"),
    ({"global_steps": 1.5}, {}, "meta_info['global_steps'] must be an int >= 0, got 1.5"),
    ({"global_steps": True}, {}, "meta_info['global_steps'] must be an int >= 0, got True"),
    ({"rollout_seed": "7"}, {}, "meta_info['rollout_seed'] must be an int >= 0, got '7'"),
    ({}, {"_group_index": [0, 1.5]}, "non_tensor_batch['_group_index'] of row 1 must be an int >= 0, got 1.5"),
    ({}, {"_group_index": [0, "x"]}, "non_tensor_batch['_group_index'] of row 1 must be an int >= 0, got 'x'"),
    ({}, {"_rollout_seed_global_idx": [0, None]}, "non_tensor_batch['_rollout_seed_global_idx'] of row 1"),
    ({}, {"uid": ["ok", "bad\ud800"]}, "non_tensor_batch['uid'] of row 1 is not encodable text: character U+D800"),
])
def test_agent_loop_batch_fields_are_refused_naming_them(meta, columns, expected):
    from omniroll.agent_loop.manager import AgentLoopManager
    from omniroll.agent_loop.rows import plan_rows

    cfg = load_config({"n": 2})
    with pytest.raises(ValueError) as e:
        plan_rows(cfg, AgentLoopManager.prepare(_batch(meta, **columns)))  # what the manager runs before any split
    assert expected in str(e.value) and "\n" not in str(e.value)
    assert type(e.value) is ValueError  # never a bare UnicodeEncodeError / int() error


def test_numpy_integers_are_fine_in_batch_fields():
    from omniroll.agent_loop.rows import plan_rows

    cfg = load_config({"n": 2})
    rows = plan_rows(cfg, _batch({"global_steps": np.int64(3), "rollout_seed": np.int32(5)},
                                 _group_index=np.array([0, 1], dtype=object)))
    assert [r["_group_index"] for r in rows] == [0, 1] and rows[0]["request_id"] == "train/s3/u/0"


# ------------------------------------------------------------------------------------------------------ engine
@pytest.mark.parametrize("field", ["num_inference_steps", "height", "guidance_scale", "noise_level", "latent_seed"])
def test_a_bool_is_not_a_number_in_sampling_params(field):
    from omniroll.engine.params import SamplingParams

    with pytest.raises(ValidationError, match=rf"{field}\n  Value error, must be a number, got the bool True"):
        SamplingParams(**{field: True})
    assert SamplingParams(logprobs=False).logprobs is False  # a real bool field still takes bools


def test_a_bool_seed_and_a_bytes_prompt_are_refused_not_coerced():
    from omniroll.engine.params import GenerationRequest

    with pytest.raises(ValidationError, match=r"seed\n  Value error, must be a number, got the bool True"):
        GenerationRequest(request_id="r", prompt="a cat", seed=True)
    with pytest.raises(ValidationError, match="must be a number, got the bool True"):  # as a JSON body gives it
        GenerationRequest.model_validate({"request_id": "r", "prompt": "x", "seed": 1,
                                          "sampling_params": {"num_inference_steps": True}})
    for field in ("prompt", "negative_prompt"):
        kwargs = {"prompt": "a cat", field: b"a cat"}
        with pytest.raises(ValidationError, match=rf"{field}\n  Value error, must be text \(str\), got bytes"):
            GenerationRequest(request_id="r", seed=1, **kwargs)


# --------------------------------------------------------------------------------------------- a disk that fills
def _limit_file_size(max_bytes: int):
    """In the child: any write past `max_bytes` in one file fails with EFBIG ("File too large"), as a full disk
    fails with ENOSPC (Python ignores SIGXFSZ, so the write raises instead of killing the process)."""
    def apply():
        import resource

        resource.setrlimit(resource.RLIMIT_FSIZE, (max_bytes, max_bytes))

    return apply


@pytest.mark.slow  # slow: the CLI in a subprocess
def test_generate_on_a_full_disk_names_the_file_and_what_was_kept(tiny_sd3_path, tmp_path):
    root = os.path.dirname(tiny_sd3_path)  # "tiny" resolves to the session's tiny checkpoint (as in test_cli)
    if not os.path.exists(os.path.join(root, "tiny-sd3")):
        os.symlink(tiny_sd3_path, os.path.join(root, "tiny-sd3"))
    out = tmp_path / "gen"
    args = ["generate", "--prompt", "a red car", "--prompt", "a dog", "--model", "tiny", "--n", "2", "--steps", "2",
            "--height", "64", "--width", "64", "--max-sequence-length", "16", "--quiet", "--out", str(out)]
    code = "import sys; from omniroll.cli import main; sys.exit(main(sys.argv[1:]))"
    # the two PNG grids (~22 kB each) fit, the trajectory file (~200 kB) does not
    proc = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMNIROLL_CACHE": root}, preexec_fn=_limit_file_size(100_000))
    assert proc.returncode == 1, proc.stderr
    errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("omniroll generate: error:")]
    assert len(errors) == 2 and "internal error" not in proc.stderr and "Traceback" not in proc.stderr
    assert errors[0] == (f"omniroll generate: error: could not write {out / 'trajectories.safetensors'}: "
                         f"File too large (EFBIG)")
    assert errors[1] == (f"omniroll generate: error: kept: 2 complete file(s) in {out}: prompt_000.png, "
                         f"prompt_001.png; not written: trajectories.safetensors, so the samples' log-probs, latents "
                         f"and scores are lost (the same command with the same seeds regenerates them bitwise)")
    assert sorted(p.name for p in out.iterdir()) == ["prompt_000.png", "prompt_001.png"]  # no partial file left


@pytest.mark.slow  # slow: the CLI in a subprocess
def test_a_sample_file_that_cannot_be_written_is_named_and_removed(tmp_path):
    """Images and videos (PIL / PyAV write them, not `write_bytes`) fail the same way, leaving no partial file."""
    code = ("import sys, torch; from pathlib import Path; from omniroll.media import save_sample\n"
            "g = torch.Generator().manual_seed(0)\n"
            "try:\n"
            "    save_sample(torch.randint(0, 256, (3, 64, 64), dtype=torch.uint8, generator=g), Path(sys.argv[1]))\n"
            "except OSError as e:\n"
            "    print(type(e).__name__, e)\n")
    proc = subprocess.run([sys.executable, "-c", code, str(tmp_path / "s0")], capture_output=True, text=True,
                          timeout=120, preexec_fn=_limit_file_size(1000))
    assert proc.stdout.strip() == f"OutputWriteError could not write {tmp_path / 's0.png'}: File too large (EFBIG)"
    assert list(tmp_path.iterdir()) == []
