"""The command line, end to end on the tiny model."""

import contextlib
import json
import os
import signal
import stat

import pytest
import torch

from omniroll.cli import main
from omniroll.engine.execution import BatchInvariantMode
from omniroll.models import load_adapter
from omniroll.sampling import sde_step
from omniroll.trajectory_file import DOCUMENTED_KEYS, read_trajectories


@pytest.fixture()
def tiny_cache(tiny_sd3_path, monkeypatch):
    # point the CLI's "tiny" at the session's tiny checkpoint (same builder, same seed)
    import os

    root = os.path.dirname(tiny_sd3_path)
    os.makedirs(root, exist_ok=True)
    link = os.path.join(root, "tiny-sd3")
    if not os.path.exists(link):
        os.symlink(tiny_sd3_path, link)
    monkeypatch.setenv("OMNIROLL_CACHE", root)


GEN = ["--model", "tiny", "--n", "2", "--steps", "4", "--height", "64", "--width", "64",
       "--max-sequence-length", "16", "--window-size", "2", "--window-range", "0", "3", "--quiet"]


def test_generate_writes_grids_trajectories_metrics(tiny_cache, tmp_path, capsys):
    out = tmp_path / "gen"
    rc = main(["generate", "--prompt", "a red car", "--prompt", "a dog", *GEN, "--max-batch-size", "auto",
               "--out", str(out)])
    assert rc == 0
    printed = capsys.readouterr().out
    for name in ("prompt_000.png", "prompt_001.png", "trajectories.safetensors", "metrics.json"):
        assert (out / name).exists() and str((out / name).resolve()) in printed  # lists what it wrote
        assert stat.S_IMODE(os.stat(out / name).st_mode) == 0o644
    traj = read_trajectories(str(out / "trajectories.safetensors"))
    assert traj.batch["responses"].shape == (4, 3, 64, 64) and traj.batch["responses"].dtype == torch.uint8
    assert traj.batch["all_latents"].shape[:2] == (4, 3) and traj.batch["rollout_log_probs"].shape == (4, 2)
    assert list(traj.non_tensor_batch["raw_prompt"]) == ["a red car"] * 2 + ["a dog"] * 2
    assert traj.non_tensor_batch["sampling_params"][0]["height"] == 64
    assert set(traj.batch.keys()) - DOCUMENTED_KEYS <= {k for k in traj.batch.keys() if k.endswith("_mask")}
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["num_images"] == 4 and metrics["images_per_second"] > 0
    run = metrics["run"]
    assert run == traj.meta_info["run"]
    assert run["device"] == "cpu" and run["dtype"] == "float32" and run["batch_invariant"] is True
    assert run["versions"]["torch"] == torch.__version__ and len(metrics["seeds"]) == 4


def test_generate_with_algo_tree_makes_each_prompt_a_tree(tiny_cache, tmp_path, monkeypatch):
    """`algo.tree`: the prompt's n samples are its tree's leaves (the agent loop's derivation): one root seed,
    siblings equal up to their fork and apart from it."""
    monkeypatch.setenv("OMNIROLL_OVERRIDES", "algo.tree.fork_steps=[2,4] algo.tree.widths=[2,2]")
    out = tmp_path / "gen"
    args = ["--model", "tiny", "--n", "4", "--steps", "6", "--height", "64", "--width", "64",
            "--max-sequence-length", "16", "--quiet"]
    assert main(["generate", "--prompt", "a red car", *args, "--out", str(out)]) == 0
    traj = read_trajectories(str(out / "trajectories.safetensors"))
    lat = traj.batch["all_latents"]  # the window is steps 0-4: all_latents[k] is the latent before step k
    assert len(set(traj.non_tensor_batch["seed"])) == 1
    assert torch.equal(lat[0, :5], lat[1, :5]) and not torch.equal(lat[0, 5], lat[1, 5])  # fork at step 4
    assert torch.equal(lat[0, :3], lat[2, :3]) and not torch.equal(lat[0, 3], lat[2, 3])  # fork at step 2
    assert [p["noise_seeds"][0][0] for p in traj.non_tensor_batch["sampling_params"]] == [2] * 4


def test_every_log_prob_recomputes_from_the_file_alone(tiny_cache, tmp_path):
    """Only the file: the model path, embeddings, latents, timesteps, sigmas, noise level, SDE type, sigma_max and
    guidance per row come from it; each recomputed log-prob equals the recorded one bitwise."""
    out = tmp_path / "gen"
    assert main(["generate", "--prompt", "a red car", "--prompt", "a dog", *GEN, "--out", str(out)]) == 0
    traj = read_trajectories(str(out / "trajectories.safetensors"))
    b, nt, run = traj.batch, traj.non_tensor_batch, traj.meta_info["run"]
    adapter = load_adapter(run["model"])
    mode = BatchInvariantMode() if run["batch_invariant"] else contextlib.nullcontext()
    W = b["rollout_log_probs"].shape[1]
    for i in range(len(traj)):
        def embeds(prefix):
            m = b[f"{prefix}prompt_embeds_mask"][i].bool()
            return {"prompt_embeds": b[f"{prefix}prompt_embeds"][i][m],
                    "pooled_prompt_embeds": b[f"{prefix}pooled_prompt_embeds"][i]}
        cond, uncond = embeds(""), embeds("negative_")
        rows = {k: torch.stack([uncond[k], cond[k]]) for k in cond}  # [uncond, cond], as diffusers
        for k in range(W):
            x = b["all_latents"][i, k]
            with mode:
                v_uncond, v_cond = adapter.velocity(torch.stack([x, x]), b["all_timesteps"][i, k].repeat(2), rows)
            v = v_uncond + b["cfg_scale"][i] * (v_cond - v_uncond)
            logp = sde_step(x[None], v[None], b["sigmas"][i, k], b["sigmas_next"][i, k], b["noise_level"][i],
                            nt["sde_type"][i], prev_sample=b["all_latents"][i, k + 1][None],
                            sigma_max=b["sigma_max"][i]).log_prob
            assert torch.equal(logp[0], b["rollout_log_probs"][i, k]), (i, k)


def test_generate_keeps_finished_samples_on_ctrl_c(tiny_cache, tmp_path, monkeypatch, capsys):
    """A real SIGINT after two samples finished: exit 130, those two are written, nothing else."""
    from omniroll.engine.engine import DiffusionEngine

    original = DiffusionEngine.generate_async
    finished = []

    async def interrupt_after_two(self, request):
        out = await original(self, request)
        finished.append(request.request_id)
        if len(finished) == 2:
            signal.raise_signal(signal.SIGINT)
        return out

    monkeypatch.setattr(DiffusionEngine, "generate_async", interrupt_after_two)
    out = tmp_path / "gen"
    rc = main(["generate", "--prompt", "a red car", "--prompt", "a dog", "--prompt", "a cat", *GEN,
               "--max-batch-size", "2", "--out", str(out)])
    assert rc == 130
    traj = read_trajectories(str(out / "trajectories.safetensors"))
    assert 2 <= len(traj) < 6 and set(traj.non_tensor_batch["request_id"]) <= set(finished)
    assert json.loads((out / "metrics.json").read_text())["interrupted"] is True
    assert "interrupted" in capsys.readouterr().err


@pytest.fixture()
def nothing_starts(monkeypatch):
    """Fail the test if a model is loaded or Ray replicas are started (errors must come before both)."""
    import omniroll.run_rollout
    from omniroll.engine.engine import DiffusionEngine

    def refuse(*a, **k):
        raise AssertionError("started expensive work before reporting the input error")

    monkeypatch.setattr(DiffusionEngine, "from_pretrained", classmethod(refuse))
    monkeypatch.setattr(omniroll.run_rollout, "run_rollout", refuse)


def _errors(capsys) -> list[str]:
    err = capsys.readouterr().err
    assert "Traceback" not in err and "pydantic.dev" not in err and "validation error" not in err
    return err.strip().splitlines()


def test_bad_input_fails_before_starting_one_line_per_error(tiny_cache, tmp_path, capsys, nothing_starts):
    out = str(tmp_path)
    assert main(["generate", "--prompt", "x", "--steps", "0", "--guidance", "-1", "--out", out]) == 2
    lines = _errors(capsys)
    assert len(lines) == 2 and lines[0].startswith("omniroll generate: error: --steps (pipeline.num_inference_steps)")
    assert "--guidance (pipeline.guidance_scale)" in lines[1]
    # limits read from the checkpoint's config files (no weights loaded): resolution multiple and maximum
    assert main(["generate", "--prompt", "x", "--height", "100", "--width", "4096", "--out", out]) == 2
    lines = _errors(capsys)
    assert len(lines) == 2 and "--height (pipeline.height): must be a positive multiple of 16" in lines[0]
    assert "--width (pipeline.width): must be <= 1024" in lines[1]
    assert main(["generate", "--model", str(tmp_path), "--prompt", "x", "--out", out]) == 2
    assert "--model (engine.model)" in _errors(capsys)[0]
    assert main(["generate", "--model", "stabilityai/stable-diffusion-3.5-medium", "--prompt", "x", "--out", out]) == 2
    assert "hf download stabilityai/stable-diffusion-3.5-medium --local-dir" in _errors(capsys)[0]
    assert main(["generate", "--prompts-file", str(tmp_path / "missing.txt"), "--out", out]) == 2
    assert _errors(capsys) == [f"omniroll generate: error: --prompts-file: file not found: {tmp_path / 'missing.txt'}"]
    assert main(["generate", "--prompt", "x", "--override", "pipeline.heigth=64", "--out", out]) == 2
    assert "pipeline.heigth: Extra inputs are not permitted" in _errors(capsys)[0]
    assert main(["generate", "--prompt", "x", "--max-batch-size", "1", "--out", out]) == 2
    assert "--max-batch-size (engine.max_batch_size)" in _errors(capsys)[0]
    with pytest.raises(SystemExit) as exit_:
        main(["generate", "--prompt", "x", "--max-batch-size", "lots", "--out", out])
    assert exit_.value.code == 2 and "expected an int >= 2 or 'auto', got 'lots'" in capsys.readouterr().err


#: the least each command that writes a directory needs before its --out (export: --to)
WRITING_COMMANDS = [
    ["demo"], ["generate", "--prompt", "a red car"], ["eval", "--model", "shapes", "--prompts", "heldout"],
    ["rollout", "--config", "examples/rollout.yaml", "--prompts", "examples/prompts.txt"],
    ["train", "--config", "examples/train.yaml"], ["pretrain", "shapes"], ["pretrain", "shapes-video"],
    ["pretrain", "shapes-proxy"],
    ["export", "no-checkpoint"]]


@pytest.mark.parametrize("argv", WRITING_COMMANDS)
def test_an_output_directory_that_cannot_be_written_fails_first_naming_the_flag(argv, tmp_path, capsys,
                                                                                 nothing_starts):
    """Every command's --out (export's --to) under a file, or a file itself: exit 2 with one line naming the flag,
    before anything loads (before, the work ran first and its results were lost to an internal error)."""
    from omniroll.cli import COMMANDS

    flag = "--to" if argv[0] == "export" else "--out"
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    assert main(argv + [flag, str(blocker / "out")]) == 2
    assert _errors(capsys) == [f"omniroll {argv[0]}: error: {flag} {blocker / 'out'}: cannot be created: {blocker} "
                               f"is a file, not a directory"]
    assert main(argv + [flag, str(blocker)]) == 2
    assert _errors(capsys) == [f"omniroll {argv[0]}: error: {flag} {blocker}: is a file, not a directory"]
    assert {a[0] for a in WRITING_COMMANDS} == set(COMMANDS) - {"serve", "doctor"}  # all but the two that write none


def test_rollout_checks_rewards_prompt_length_and_sampling_before_ray(tiny_cache, tmp_path, capsys, nothing_starts):
    base = ["rollout", "--config", "examples/rollout.yaml", "--prompts", "examples/prompts.txt", "--out", str(tmp_path)]
    assert main(base + ["--override", "prompt_length=10"]) == 2
    lines = _errors(capsys)
    assert len(lines) == 1 and "prompt_length: must be >= 77" in lines[0] and lines[0].endswith("got 10")
    rc = main(base + ["--override", "reward.functions.compressibility.fn=jpeg_compresibility",
                      "--override", "reward.functions.mine.fn=tests.reward_fns:no_such_fn",
                      "--override", "val_kwargs.pipeline.height=100", "--validate"])
    assert rc == 2
    lines = _errors(capsys)
    assert len(lines) == 3, lines
    assert any("val_kwargs.pipeline.height: must be a positive multiple of 16" in x for x in lines)
    assert any("reward.functions.compressibility.fn: unknown reward function 'jpeg_compresibility'" in x for x in lines)
    assert any("reward.functions.mine.fn:" in x and "no_such_fn" in x for x in lines)


def test_config_n_and_val_kwargs_n_are_honoured(tmp_path):
    from omniroll.cli import build_parser
    from omniroll.cli.common import build_config

    (tmp_path / "c.yaml").write_text("n: 3\nval_kwargs: {n: 5}\nseed: 11\n")
    args = build_parser().parse_args(["generate", "--config", str(tmp_path / "c.yaml"), "--prompt", "x"])
    cfg = build_config(args)
    assert (cfg.n, cfg.val_kwargs.n, cfg.seed) == (3, 5, 11)
    args = build_parser().parse_args(["generate", "--config", str(tmp_path / "c.yaml"), "--n", "2", "--prompt", "x"])
    assert build_config(args).n == 2  # a flag overrides the file


def test_help_and_import_do_not_import_torch_and_every_flag_is_documented():
    import subprocess
    import sys

    code = ("import sys, omniroll; from omniroll.cli import build_parser; build_parser().format_help(); "
            "print(sorted(m for m in ('torch', 'ray', 'diffusers') if m in sys.modules))")
    assert subprocess.check_output([sys.executable, "-c", code], text=True).strip() == "[]"
    from omniroll.cli import build_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if a.choices and "generate" in a.choices)
    for name, p in sub.choices.items():
        for action in p._actions:
            if action.dest == "help":
                continue
            assert action.help, (name, action.dest)
            documented = action.default is not None or "default:" in action.help or action.required
            assert documented, (name, action.dest)


def test_demo(tiny_cache, tmp_path, capsys):
    assert main(["demo", "--out", str(tmp_path / "demo")]) == 0
    printed = capsys.readouterr().out
    assert "omniroll demo" in printed and "trajectories.safetensors" in printed


def test_rollout_command_and_generate_give_the_same_samples(tiny_cache, tmp_path, ray_cluster):
    """One config, two commands: rollout (Ray replicas, agent loop, rewards) and generate (one engine) write the same
    layout, and the same prompt, seed and settings give bitwise the same image and log-probs."""
    settings = ["--config", "examples/rollout.yaml", "--prompts", "examples/prompts.txt", "--n", "2", "--quiet",
                "--height", "64", "--width", "64", "--steps", "4", "--max-sequence-length", "16",
                "--window-size", "2", "--window-range", "0", "3", "--seed", "7",
                "--num-threads", str(torch.get_num_threads())]
    roll, gen = tmp_path / "roll", tmp_path / "gen"
    rc = main(["rollout", *settings, "--out", str(roll), "--override", "replicas.count=1",
               "--override", "reward.num_workers=1"])
    assert rc == 0
    lines = [json.loads(line) for line in (roll / "rewards.jsonl").read_text().splitlines()]
    num_prompts = len([p for p in open("examples/prompts.txt").read().splitlines() if p.strip()])
    assert len(lines) == 2 * num_prompts and all(x["status"] == "ok" for x in lines)
    assert stat.S_IMODE(os.stat(roll / "trajectories.safetensors").st_mode) == 0o644
    assert main(["generate", *settings, "--out", str(gen)]) == 0
    a, b = (read_trajectories(str(d / "trajectories.safetensors")) for d in (roll, gen))
    assert list(a.non_tensor_batch["seed"]) == list(b.non_tensor_batch["seed"])
    assert list(a.non_tensor_batch["raw_prompt"]) == list(b.non_tensor_batch["raw_prompt"])
    for key in ("responses", "rollout_log_probs", "all_latents", "prompts", "prompt_embeds"):
        assert torch.equal(a.batch[key], b.batch[key]), key
    assert set(b.batch.keys()) <= set(a.batch.keys())  # rollout adds its rewards (rm_scores)
    assert a.meta_info["run"]["command"] == "rollout" and b.meta_info["run"]["command"] == "generate"
