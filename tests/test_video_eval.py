"""Video evaluation on the toy shapes-video checkpoint: `--model shapes-video` (shipped, or a clear error saying how
to make it), `omniroll eval` on a moving-shapes checkpoint (the world read from its omniroll_defaults.json, paired
with a baseline, the frozen and shuffled baselines), its film strips, and `omniroll generate`'s clip files."""

from __future__ import annotations

import json
import os
import shutil

import pytest

from omniroll.cli import main
from omniroll.models.checkpoint import SAMPLING_DEFAULTS_FILE, read_sampling_defaults, read_task


@pytest.fixture(scope="session")
def toy_video(tmp_path_factory) -> str:
    """A toy shapes-video checkpoint (`omniroll pretrain shapes-video --toy`: the real model's format, a few steps of
    tiny parts)."""
    from omniroll.models.shapes_video.pretrain import pretrain
    from omniroll.models.shapes_video.recipe import TOY

    out = tmp_path_factory.mktemp("toy-video")
    return pretrain(TOY, str(out), progress=False, log=lambda _: None)["checkpoint"]


def test_a_shapes_video_checkpoint_names_its_task_and_its_sampling_defaults_stay_config_sections(toy_video):
    assert read_task(toy_video) == "moving_shapes"
    assert set(read_sampling_defaults(toy_video)) == {"pipeline"}
    from omniroll.models import resolve_model

    assert read_task(resolve_model("shapes")) == "shapes"  # states none: the image world


def test_a_task_outside_the_known_worlds_is_refused_naming_the_file(toy_video, tmp_path):
    bad = tmp_path / "bad"
    shutil.copytree(toy_video, bad)
    f = bad / SAMPLING_DEFAULTS_FILE
    f.write_text(json.dumps({**json.loads(f.read_text()), "task": "cats"}))
    with pytest.raises(ValueError, match=r"'task' must be one of \['shapes', 'moving_shapes'\], got 'cats'"):
        read_task(str(bad))


def test_shapes_video_is_the_verified_shipped_checkpoint():
    from omniroll.models import SHIPPED_MODELS, resolve_model
    from omniroll.models.shapes_video import CHECKPOINT
    from omniroll.models.shipped import SUMS_FILE

    assert "shapes-video" in SHIPPED_MODELS and os.path.isfile(os.path.join(CHECKPOINT, SUMS_FILE))
    assert resolve_model("shapes-video") == CHECKPOINT and read_task(CHECKPOINT) == "moving_shapes"


def test_the_shipped_model_carries_the_video_demos_evaluation_before_training():
    """Its `evaluations/` entries read back whole (every clip's digest checked) and are the demo's two splits, CFG off
    at the demo's 16 clips a prompt and at CFG 4.5 at 2, 9-frame clips (`make shapes-video-model-evaluations`)."""
    from pathlib import Path

    from omniroll.config import load_config
    from omniroll.evaluation.cache import SHIPPED, EvaluationCache
    from omniroll.models.shapes_video import CHECKPOINT

    cfg = load_config("examples/shapes_video_demo.yaml").trainer.evaluation
    splits = [Path(f).read_text().split("\n") for f in cfg.splits]
    cache = EvaluationCache(Path(CHECKPOINT) / SHIPPED)
    found = set()
    for folder in sorted((Path(CHECKPOINT) / SHIPPED).iterdir()):
        entry = json.loads((folder / "entry.json").read_text())
        prompts = [r["prompt"] for r in entry["pictures"]]
        seeds = [int(r["seed"]) for r in entry["pictures"]]
        clips = cache.read(folder, prompts, seeds)
        assert clips is not None and clips[0].shape[0] == entry["frames"] == 9
        split = next(i for i, lines in enumerate(splits) if set(prompts) == {x for x in lines if x.strip()})
        found.add((split, len(prompts) // len(set(prompts))))
    assert found == {(i, n) for i in range(len(splits)) for n in (cfg.seeds, cfg.beside_seeds)}


def test_install_copies_a_verified_moving_shapes_checkpoint_and_refuses_others(toy_video, tmp_path):
    from omniroll.models import resolve_model
    from omniroll.models.shapes_video import checkpoint_dir, install

    dest = tmp_path / "shipped"
    with pytest.raises(FileNotFoundError) as e:  # nothing installed there: the error says how to make it
        checkpoint_dir(str(dest))
    for words in ("not shipped yet", "make shapes-video-model", "--model out/shapes-video-model/checkpoint"):
        assert words in str(e.value)
    assert install(toy_video, str(dest)) == str(dest)
    assert checkpoint_dir(str(dest)) == str(dest) and read_task(str(dest)) == "moving_shapes"
    with pytest.raises(ValueError, match="not 'moving_shapes'"):  # the shapes model is not a video model
        install(resolve_model("shapes"), str(dest))
    changed = tmp_path / "changed"
    shutil.copytree(toy_video, changed)
    (changed / "scheduler" / "scheduler_config.json").write_text("{}")
    with pytest.raises(FileNotFoundError, match="does not match its SHA256SUMS"):
        install(str(changed), str(dest))
    assert checkpoint_dir(str(dest)) == str(dest)  # a refused install leaves the installed one as it was


# the four forms, one per category (a prompts file for the CLI)
FORMS = ("a red circle moving left", "a square moving up and a triangle moving down",
         "a red circle appears, then a blue square", "a square turning from blue to green")


def rendered(seeds=(0, 1)):
    """(prompts, clips [T, H, W, 3], seeds): the renderer's own clips of FORMS."""
    from omniroll.tasks.moving_shapes.judge import frames_hwc
    from omniroll.tasks.moving_shapes.render import render_prompt

    rows = [(p, frames_hwc(render_prompt(p, s)), s) for p in FORMS for s in seeds]
    return [r[0] for r in rows], [r[1] for r in rows], [r[2] for r in rows]


def test_score_clips_is_the_checker_with_the_twin_as_chance_and_the_frames_frozen_and_shuffled_as_baselines():
    import numpy as np

    from omniroll.tasks.moving_shapes.cheats import apply_order, cheat_order
    from omniroll.tasks.moving_shapes.grammar import parse_prompt, twin_prompt
    from omniroll.tasks.moving_shapes.judge import score_clip
    from omniroll.tasks.moving_shapes.report import score_clips

    prompts, clips, seeds = rendered()
    rows = score_clips(prompts, clips, seeds)
    assert [r.tag for r in rows] == [t for t in ("direction", "two_motions", "order", "change") for _ in range(2)]
    for p, clip, s, r in zip(prompts, clips, seeds, rows):
        j = score_clip(parse_prompt(p), clip)
        assert (r.strict, r.partial, r.reasons) == (j.strict, j.partial, j.reasons)
        assert r.chance == score_clip(parse_prompt(twin_prompt(p)), clip).strict
        base = dict(r.baselines)
        assert base["frozen"] == score_clip(parse_prompt(p), apply_order(clip, cheat_order("frozen", len(clip)))).strict
        assert base["frozen"] is False  # a static clip satisfies no prompt of the world
        shuffled = cheat_order("shuffled", len(clip), np.random.default_rng([s, 7]))
        assert base["shuffled"] == score_clip(parse_prompt(p), apply_order(clip, shuffled)).strict
    assert score_clips(prompts, clips, seeds) == rows  # the shuffles are the seeds'
    with pytest.raises(ValueError, match="clip 0"):
        score_clips(prompts[:1], [clips[0][0]])  # a picture is not a clip


def test_a_clip_evaluation_writes_film_strips_its_baselines_and_a_flips_picture(tmp_path):
    import numpy as np
    from PIL import Image

    from omniroll.evaluation.paired import flips, paired
    from omniroll.evaluation.shapes import flips_picture, scored, write_evaluation
    from omniroll.tasks.moving_shapes.report import film_strip

    prompts, clips, seeds = rendered()
    new = scored(clips, prompts, seeds, "moving_shapes")
    frozen = scored([np.repeat(c[:1], len(c), axis=0) for c in clips], prompts, seeds, "moving_shapes")
    assert list(new.report.categories) == ["direction", "two_motions", "order", "change"]
    assert frozen.report.overall["strict"] == 0.0  # static clips pass nothing
    b = new.baselines()
    for tag, c in b["frozen"]["categories"].items():
        passed = sum(r.strict for r in new.rows if r.tag == tag)
        assert (c["strict"], c["n"], c["up"], c["down"]) == (0.0, 2, passed, 0)
    files = write_evaluation(new, str(tmp_path), title="rendered")
    saved = json.loads(open(files["json"]).read())
    assert saved["task"] == "moving_shapes" and saved["baselines"]["frozen"]["overall"]["strict"] == 0.0
    assert len(saved["pictures"]) == len(clips)
    grid = np.asarray(Image.open(files["grid"]).convert("RGB"))
    strip = film_strip(clips[0])
    assert strip.shape == (64, 9 * 64 + 8 * 2, 3)
    assert grid.shape[1] == 4 * (strip.shape[1] + 6)  # one row per category: 4 strips at their own size
    assert np.array_equal(grid[:64, :strip.shape[1]], strip)  # the first clip, frames left to right
    flipped = flips(frozen.picture_records(), new.picture_records())
    assert paired(frozen.picture_records(), new.picture_records())["overall"]["up"] == sum(r.strict for r in new.rows)
    path = flips_picture(frozen, new, flipped, str(tmp_path / "flips.png"), title="frozen -> rendered",
                         labels=("frozen", "rendered"))
    with Image.open(path) as im:  # up to 4 strips a row: the frozen clip above the rendered one
        assert im.width == 4 * (strip.shape[1] + 6) and im.height > 2 * 64


def test_omniroll_eval_on_a_video_checkpoint_judges_clips_in_the_moving_shapes_world_paired_with_a_baseline(
        toy_video, tmp_path, capsys):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(FORMS) + "\n")
    out = tmp_path / "eval"
    assert main(["eval", "--model", toy_video, "--prompts", str(prompts), "--seeds", "2", "--steps", "2",
                 "--baseline-guidance", "1.0", "--out", str(out), "--quiet"]) == 0
    printed = capsys.readouterr().out
    line = json.loads(next(x for x in printed.splitlines() if x.startswith("{")))
    assert line["task"] == "moving_shapes" and line["images"] == 8 and "frozen_strict" in line
    assert "frozen" in printed and "McNemar" in printed  # the frame baselines' table and the paired verdict
    assert "clip(s) fail -> pass" in printed  # clips are called clips
    ev, base = (json.loads((out / f"{n}.json").read_text()) for n in ("eval", "baseline"))
    assert ev["task"] == base["task"] == "moving_shapes"
    assert {t: c["n"] for t, c in ev["categories"].items()} == {"direction": 2, "two_motions": 2, "order": 2,
                                                                  "change": 2}
    assert set(ev["baselines"]) == {"frozen", "shuffled"} and ev["paired"]["overall"]["n"] == 8
    assert (ev["guidance_scale"], base["guidance_scale"]) == (4.5, 1.0)
    assert ev["sampling"]["num_frames"] == 9 and (out / "eval_grid.png").is_file()
    # again: the clips come from the evaluation cache (8 drawn again, bitwise equal), with the same verdicts
    assert main(["eval", "--model", toy_video, "--prompts", str(prompts), "--seeds", "2", "--steps", "2",
                 "--out", str(tmp_path / "again"), "--quiet"]) == 0
    again = json.loads((tmp_path / "again" / "eval.json").read_text())
    assert again["cache"]["read"] and again["cache"]["agreed"] == "bits", again.get("cache")
    assert again["pictures"] == ev["pictures"]


def test_omniroll_eval_refuses_a_world_that_does_not_fit_what_the_model_draws_before_any_work(toy_video, tmp_path,
                                                                                              capsys):
    out = tmp_path / "o"
    assert main(["eval", "--model", toy_video, "--override", "pipeline.num_frames=1", "--out", str(out)]) == 2
    assert "judges clips" in capsys.readouterr().err
    assert main(["eval", "--model", toy_video, "--baseline-model", "shapes", "--out", str(out)]) == 2
    assert "not judged in the moving_shapes world" in capsys.readouterr().err
    assert main(["eval", "--model", toy_video, "--prompts", "a red circle moving sideways.txt", "--out", str(out)]) == 2
    assert "--prompts" in capsys.readouterr().err
    assert not out.exists()


def test_omniroll_generate_on_a_video_checkpoint_writes_each_clip_as_a_video_file_and_a_frame_strip(toy_video,
                                                                                                    tmp_path, capsys):
    import numpy as np
    import torch
    from PIL import Image
    from safetensors import safe_open

    from omniroll.media import read_video, video_encoder

    out = tmp_path / "gen"
    assert main(["generate", "--model", toy_video, "--prompt", FORMS[0], "--n", "2", "--steps", "2", "--out",
                 str(out), "--quiet"]) == 0
    fmt = video_encoder()
    assert json.loads(next(x for x in capsys.readouterr().out.splitlines() if x.startswith("{")))["video_format"] == fmt
    with safe_open(str(out / "trajectories.safetensors"), "pt") as f:
        clips = f.get_tensor("responses")
    assert clips.shape == (2, 9, 3, 64, 64)  # the checkpoint's defaults: 9 frames of 64 px
    for j in range(2):
        video = read_video(out / f"prompt_000_s{j}.{fmt}")
        assert video.shape == (9, 3, 64, 64)
        if fmt == "webp":  # lossless
            assert torch.equal(video, clips[j])
        with Image.open(out / f"prompt_000_s{j}_frames.png") as strip:
            frames = torch.from_numpy(np.array(strip.convert("RGB"))).permute(2, 0, 1)
        assert torch.equal(frames, torch.cat(list(clips[j]), dim=2))  # the clip's frames, left to right


def test_the_video_extra_writes_an_mp4_that_reads_back_with_its_frames_size_and_verdict(tmp_path):
    pytest.importorskip("av", reason="the `video` extra (make test installs it) writes MP4")
    import numpy as np
    import torch

    from omniroll.media import read_video, save_video, video_encoder
    from omniroll.tasks.moving_shapes.grammar import parse_prompt
    from omniroll.tasks.moving_shapes.judge import score_clip

    assert video_encoder() == "mp4"
    prompts, clips, _ = rendered(seeds=(0,))
    for k, (prompt, clip) in enumerate(zip(prompts, clips)):
        written = np.ascontiguousarray(clip.transpose(0, 3, 1, 2))  # [T, 3, H, W]
        path = save_video(torch.from_numpy(written), tmp_path / f"clip{k}", fps=8)
        assert path.suffix == ".mp4"
        back = read_video(path).numpy()
        assert back.shape == written.shape == (9, 3, 64, 64)
        other = np.ascontiguousarray(clips[(k + 1) % len(clips)].transpose(0, 3, 1, 2))
        near = np.abs(back.astype(int) - written).mean()
        assert near < np.abs(back.astype(int) - other).mean()  # H.264 is lossy: nearer the clip written than another
        spec = parse_prompt(prompt)
        assert score_clip(spec, back).strict == score_clip(spec, written).strict  # and it shows what was written


def video_trainer_config(model: str, prompts_file, task: str = "moving_shapes", splits=None):
    from omniroll.config import load_config

    return load_config({
        "replicas": {"count": 1, "num_cpus": 1},
        "engine": {"model": model, "max_batch_size": 8, "num_threads": 1},
        "pipeline": {"num_inference_steps": 2},
        "agent": {"num_workers": 1},
        "reward": {"num_workers": 1, "functions": {"ms": {"fn": "moving_shapes"}}},
        "n": 2, "seed": 0, "val_kwargs": {"n": 1},
        "trainer": {"algorithm": "awm", "prompts_file": str(prompts_file), "prompts_per_step": 2, "lr": 0.003,
                    "micro_batch_size": 4, "steps": 1, "num_threads": 1,
                    "evaluation": {"task": task, "splits": splits or [str(prompts_file)], "seeds": 1,
                                   "guidance_scales": [1.0]}},
    })


def test_the_trainer_evaluation_task_must_be_the_models_world_and_its_splits_that_worlds(toy_video, tmp_path):
    from omniroll.config import ConfigError

    prompts = tmp_path / "p.txt"
    prompts.write_text("\n".join(FORMS) + "\n")
    assert video_trainer_config(toy_video, prompts, splits=["heldout"]).trainer.evaluation.task == "moving_shapes"
    with pytest.raises(ConfigError, match="trainer.evaluation.task: .* draws for the moving_shapes world"):
        video_trainer_config(toy_video, prompts, task="shapes", splits=["heldout"])
    shapes_file = tmp_path / "s.txt"
    shapes_file.write_text("a red circle\n")  # a shapes prompt is outside the moving-shapes grammar
    with pytest.raises(ConfigError, match="moving-shapes grammar"):
        video_trainer_config(toy_video, prompts, splits=[str(shapes_file)])


def test_the_trainer_evaluates_a_video_model_before_and_after_on_its_clips(ray_cluster, toy_video, tmp_path):
    from omniroll.train import Trainer

    prompts = tmp_path / "p.txt"
    prompts.write_text("\n".join(FORMS) + "\n")
    with Trainer(video_trainer_config(toy_video, prompts), str(tmp_path / "run"), log=lambda _: None) as tr:
        tr.train()
    ev = tmp_path / "run" / "eval"
    before, after = (json.loads((ev / f"{t}_p_cfg1.json").read_text()) for t in ("before", "after"))
    assert before["task"] == after["task"] == "moving_shapes" and set(after["baselines"]) == {"frozen", "shuffled"}
    assert {t: c["n"] for t, c in after["categories"].items()} == {t: 1 for t in ("direction", "two_motions",
                                                                                   "order", "change")}
    assert (ev / "after_p_cfg1_grid.png").is_file()
    records = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert any("eval/p_cfg1/paired_z" in r for r in records)  # after paired with before, clip by clip


def test_the_validation_grid_draws_a_video_as_its_film_strip(tmp_path):
    import numpy as np
    import torch
    from PIL import Image

    from omniroll.tasks.moving_shapes.report import film_strip
    from omniroll.train.report.val_grid import save_val_grid

    _, clips, _ = rendered(seeds=(0,))
    videos = torch.from_numpy(np.stack([c.transpose(0, 3, 1, 2) for c in clips]))  # [4, T, 3, H, W]
    save_val_grid(videos, 2, 2, str(tmp_path / "val.png"), captions=[[f"clip {i}", "reward +1.0000"] for i in range(4)])
    grid = np.asarray(Image.open(tmp_path / "val.png").convert("RGB"))
    strip = film_strip(clips[0])
    assert grid.shape[1] == 2 * strip.shape[1]  # two strips a row, at their own size
    assert np.array_equal(grid[:strip.shape[0], :strip.shape[1]], strip)


def test_doctor_reports_the_shapes_video_model_off_until_shipped_then_checks_its_files(toy_video, tmp_path):
    from omniroll.cli.doctor import shapes_video_model_check

    assert shapes_video_model_check(str(tmp_path / "none")).status == "off"
    assert "make shapes-video-model" in shapes_video_model_check(str(tmp_path / "none")).detail
    copy = tmp_path / "checkpoint"
    shutil.copytree(toy_video, copy)
    assert shapes_video_model_check(str(copy)).status == "ok"
    (copy / "model_index.json").write_text((copy / "model_index.json").read_text() + " ")
    check = shapes_video_model_check(str(copy))
    assert check.status == "fail" and "model_index.json" in check.detail and "make shapes-video-model" in check.detail
    assert shapes_video_model_check().status in ("off", "ok")  # this installation's: not shipped yet, or whole


def test_the_pretrain_evaluation_judges_a_video_checkpoint_in_its_world_split_by_split(toy_video, tmp_path, capsys):
    from omniroll.cli.pretrain import evaluate_checkpoint

    prompts = tmp_path / "four.txt"
    prompts.write_text("\n".join(FORMS) + "\n")
    out = evaluate_checkpoint(toy_video, str(tmp_path / "ev"), 1, progress=False, splits=(str(prompts),))
    assert list(out) == ["four"] and out["four"]["task"] == "moving_shapes" and "evaluation" not in out["four"]
    assert out["four"]["overall"]["n"] == 4 and set(out["four"]["baselines"]) == {"frozen", "shuffled"}
    json.dumps(out)  # what pretrain.json records
    assert json.loads((tmp_path / "ev" / "eval_four.json").read_text())["task"] == "moving_shapes"
    assert "frozen" in capsys.readouterr().out  # the table, its frame baselines under it
