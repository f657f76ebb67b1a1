"""Experiment tracking (`trainer.logger`), read back with each library's own reader, and a `--resume` that never
unpickles: a 2-step `omniroll train` to tensorboard + wandb (offline) + mlflow (file store), resumed for a third step
into the same tracker runs; a crafted trainer_state.pt that would run code is refused; a named tracker that is not
installed fails before anything starts with its pip command."""

import glob
import json
import os
import struct
import sys
import time

import pytest
import torch
import yaml

from omniroll.config import load_config
from tests.test_train import train_config

LOGGERS = ["console", "jsonl", "tensorboard", "wandb", "mlflow"]


def wandb_history(run_dir):
    """The history rows of an offline wandb run, read from its run-<id>.wandb file (LevelDB log records of wandb's own
    protobuf `Record`; wandb >= 0.20 ships no Python scanner for them)."""
    from wandb.proto import wandb_internal_pb2 as pb

    (path,) = glob.glob(os.path.join(run_dir, "run-*.wandb"))
    data = open(path, "rb").read()
    assert data[:4] == b":W&B"
    block, pos, records, part = 32768, 7, [], b""
    while pos + 7 <= len(data):
        left = block - pos % block
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7]) if left >= 7 else (0, 0, 0)
        if left < 7 or (kind == 0 and length == 0):  # block trailer / zero padding
            pos += left
            continue
        chunk, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
        part = chunk if kind in (1, 2) else part + chunk
        if kind in (1, 4):
            records.append(part)
    rows = []
    for raw in records:
        rec = pb.Record()
        rec.ParseFromString(raw)
        if rec.WhichOneof("record_type") == "history":
            rows.append({i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in rec.history.item})
    return rows


def wandb_history_once(run_dir, written, timeout_s=60.0):
    """`wandb_history` as soon as `written(rows)` holds, or as it is at `timeout_s`: `run.finish()` returns before
    wandb-core has closed the run's file (its `inform_finish` is sent without waiting), so the last records reach
    the disk a moment after a run ends, later on a busy machine."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            rows = wandb_history(run_dir)
        except Exception:  # noqa: BLE001 - a record cut off where the file ends for now
            rows = None
        if rows is not None and written(rows):
            return rows
        time.sleep(0.5)
    return wandb_history(run_dir)


def test_two_steps_to_tensorboard_wandb_mlflow_read_back_and_resume_continues_the_runs(
        ray_cluster, tiny_sd3_path, tmp_path, monkeypatch, capsys):
    pytest.importorskip("tensorboard")
    pytest.importorskip("wandb")
    mlflow = pytest.importorskip("mlflow")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from omniroll.cli import main
    from omniroll.train.checkpoint import read_trainer_state

    uri = "file:" + str(tmp_path / "mlruns")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    monkeypatch.delenv("TENSORBOARD_DIR", raising=False)
    monkeypatch.delenv("WANDB_DIR", raising=False)
    cfg = train_config(tiny_sd3_path, steps=2, logger=LOGGERS, project_name="omniroll-test", experiment_name="demo",
                       log_images_every=1, log_images_count=2, prompts_per_step=1)
    cfg = load_config(cfg, overrides=["reward.functions.jpeg.fn=jpeg_compressibility",
                                      "reward.functions.jpeg.weight=0.1"])
    cfg_file = tmp_path / "train.yaml"
    cfg_file.write_text(yaml.safe_dump(cfg.model_dump(mode="json")))
    out = str(tmp_path / "run")

    assert main(["train", "--config", str(cfg_file), "--out", out]) == 0  # no --quiet: stdout is not a terminal
    std = capsys.readouterr()
    step_lines = [ln for ln in std.out.splitlines() if ln.startswith("step ")]
    assert [ln.split()[1] for ln in step_lines] == ["1/2", "2/2"]  # one clean line per step, no progress bar
    assert "\r" not in std.out + std.err and "it/s" not in std.err

    # tensorboard, through its own event reader
    tb = EventAccumulator(os.path.join(out, "tensorboard", "demo"), size_guidance={"images": 0, "histograms": 0,
                                                                                    "scalars": 0, "tensors": 0})
    tb.Reload()
    tags = tb.Tags()
    assert [e.step for e in tb.Scalars("reward/mean")] == [1, 2]
    want = {"reward/std", "reward/zero_std_ratio", "actor/clipfrac", "actor/approx_kl", "actor/ratio_max_abs_dev",
            "timing/rollout_s", "timing/step_s", "reward/colour/mean", "reward/jpeg/mean", "val/reward_mean"}
    assert want <= set(tags["scalars"]), want - set(tags["scalars"])
    assert [e.value for e in tb.Scalars("actor/ratio_max_abs_dev")] == [0.0, 0.0]
    # the ratio statistics per denoising step (every window of 2 in steps [0, 3) holds step 1), VeRL-Omni's names:
    # one optimizer update per step, so every ratio is exactly 1
    per_step = {f"actor/{name}_ts_1" for name in ("ratio_mean", "ratio_std", "pg_clipfrac_higher", "pg_clipfrac_lower",
                                                  "logprob_abs_diff", "ratio_samples")}
    assert per_step | {"actor/ratio_mean", "actor/ratio_std"} <= set(tags["scalars"])
    assert [e.value for e in tb.Scalars("actor/ratio_mean_ts_1")] == [1.0, 1.0]
    assert [e.value for e in tb.Scalars("actor/pg_clipfrac_higher_ts_1")] == [0.0, 0.0]
    assert [e.step for e in tb.Histograms("reward/hist")] == [1, 2]
    assert [e.step for e in tb.Images("train/samples/0")] == [1, 2]
    assert tb.Images("val/grid/0") and tb.Images("val/samples/0")

    # wandb offline run files
    (wb_dir,) = glob.glob(os.path.join(out, "wandb", "offline-run-*"))
    rows = wandb_history_once(wb_dir, lambda rows: {r.get("_step") for r in rows if "reward/mean" in r} >= {1, 2})
    by_step = {r["_step"]: r for r in rows if "reward/mean" in r}
    assert sorted(by_step) == [1, 2] and "actor/clipfrac" in by_step[2] and "reward/jpeg/mean" in by_step[2]
    assert by_step[2]["actor/ratio_mean_ts_1"] == 1.0
    hist = [r for r in rows if r.get("reward/hist/_type") == "histogram"]
    assert len(hist) >= 2 and sum(hist[0]["reward/hist/values"]) == 4  # one prompt x n=4 samples
    images = [r for r in rows if r.get("train/samples/_type") == "images/separated"]
    assert images and " | " in images[0]["train/samples/captions"][0]
    assert os.path.isfile(os.path.join(wb_dir, "files", images[0]["train/samples/filenames"][0]))

    # mlflow, through its client
    state = read_trainer_state(os.path.join(out, "checkpoints", "step_000002"))["tracking"]
    client = mlflow.MlflowClient(uri)
    run_id = state["mlflow_run_id"]
    assert client.get_run(run_id).info.run_name == "demo"
    assert [m.step for m in client.get_metric_history(run_id, "reward/mean")] == [1, 2]
    assert client.get_metric_history(run_id, "actor/approx_kl")
    assert [a.path for a in client.list_artifacts(run_id, "images")]
    artifacts = client.get_run(run_id).info.artifact_uri
    h = mlflow.artifacts.load_dict(artifacts + "/histograms/reward/hist/step_000002.json")
    assert len(h["values"]) == 4 and sum(h["counts"]) == 4

    # --resume: one more step into the same tracker runs
    assert main(["train", "--config", str(cfg_file), "--out", out, "--resume", out, "--steps", "3", "--quiet"]) == 0
    assert [m.step for m in client.get_metric_history(run_id, "reward/mean")] == [1, 2, 3]
    tb = EventAccumulator(os.path.join(out, "tensorboard", "demo"))
    tb.Reload()
    assert [e.step for e in tb.Scalars("reward/mean")] == [1, 2, 3]
    runs = sorted(glob.glob(os.path.join(out, "wandb", "offline-run-*")))
    assert len(runs) == 2 and all(os.path.basename(r).endswith(state["wandb_run_id"]) for r in runs)
    step_3 = lambda rows: any(r.get("_step") == 3 and "reward/mean" in r for r in rows)  # noqa: E731
    assert step_3(wandb_history_once(runs[1], step_3))


class _RunsCode:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (exec, (f"open({self.marker!r}, 'w').write('ran')",))


def test_resume_never_unpickles_code_and_old_states_fail_clearly(tmp_path, monkeypatch, capsys, tiny_sd3_path):
    from omniroll.cli import main
    from omniroll.train import trainer

    monkeypatch.setattr(trainer.Trainer, "start", lambda self: pytest.fail("started despite a bad --resume"))
    cfg_file = tmp_path / "train.yaml"
    cfg_file.write_text(yaml.safe_dump(train_config(tiny_sd3_path).model_dump(mode="json")))
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    marker = tmp_path / "marker"
    torch.save({"step": 1, "version": 1, "mode": "lora", "optimizer": {}, "x": _RunsCode(str(marker))},
               ckpt / "trainer_state.pt")
    torch.load(ckpt / "trainer_state.pt", weights_only=False)  # the crafted file does run code when unpickled
    assert marker.exists()
    marker.unlink()
    assert main(["train", "--config", str(cfg_file), "--out", str(tmp_path / "o"), "--resume", str(ckpt)]) == 2
    err = capsys.readouterr().err
    assert "trainer_state.pt" in err and "refused" in err and len(err.strip().splitlines()) == 1
    assert not marker.exists()

    torch.save({"step": 1, "optimizer": {}}, ckpt / "trainer_state.pt")  # a state without this version's keys
    assert main(["train", "--config", str(cfg_file), "--out", str(tmp_path / "o"), "--resume", str(ckpt)]) == 2
    assert "missing ['version', 'mode']" in capsys.readouterr().err


def test_a_tracker_that_is_not_installed_fails_before_anything_with_its_pip_command(
        tmp_path, monkeypatch, capsys, tiny_sd3_path):
    from omniroll.cli import main
    from omniroll.train import trainer

    monkeypatch.setattr(trainer.Trainer, "start", lambda self: pytest.fail("started without wandb"))
    monkeypatch.setitem(sys.modules, "wandb", None)  # how Python marks a module that cannot be imported
    cfg_file = tmp_path / "train.yaml"
    cfg_file.write_text(yaml.safe_dump(train_config(tiny_sd3_path, logger=["console", "wandb"]).model_dump(
        mode="json")))
    assert main(["train", "--config", str(cfg_file), "--out", str(tmp_path / "o")]) == 2
    assert "trainer.logger: 'wandb' is not installed: pip install 'omniroll[wandb]'" in capsys.readouterr().err
    cfg_file.write_text(cfg_file.read_text().replace("- wandb", "- neptune"))
    assert main(["train", "--config", str(cfg_file), "--out", str(tmp_path / "o")]) == 2
    assert "trainer.logger" in capsys.readouterr().err and not (tmp_path / "o").exists()


def test_tracker_names_keep_unknown_keys_under_a_prefix():
    from omniroll.train.report.tracking import scalars, tracker_name

    m = {"step": 3, "reward_mean": 0.5, "clip_frac": 0.25, "tied_groups": 1, "num_groups": 4, "num_samples": 8,
         "step_s": 2.0, "rollout_s": 1.0, "staleness_mean": 0.5, "queue_wait_s": 0.1, "something_new": 7,
         "off_policy/max_lag": 2, "partial": True, "note": "text", "per_fn": {"a": 1.0}}
    s = scalars(m)
    assert s["reward/mean"] == 0.5 and s["actor/clipfrac"] == 0.25 and s["timing/rollout_s"] == 1.0
    assert s["reward/zero_std_ratio"] == 0.25 and s["perf/samples_per_s"] == 4.0
    assert s["async/staleness_mean"] == 0.5 and s["timing/queue_wait_s"] == 0.1 and s["train/something_new"] == 7
    assert s["off_policy/max_lag"] == 2 and s["async/partial"] == 1.0 and s["train/per_fn/a"] == 1.0
    assert "step" not in s and not any("note" in k for k in s)
    assert tracker_name("val_reward_mean") == "val/reward_mean"


#: a step's metrics as the step line needs them
STEP = {"step": 1, "reward_mean": 0.1, "reward_std": 0.01, "ratio_max_abs_dev": 0.0, "clip_frac": 0.0,
        "approx_kl": 0.0, "kl": 3e-3, "loss": 0.0, "grad_norm": 0.1, "weight_version": 0, "rollout_s": 1.0,
        "reward_wait_s": 0.0, "train_s": 1.0, "sync_s": 0.0, "step_s": 2.0}


def test_the_step_line_shows_the_total_it_is_given_and_the_curve_names_the_algorithm_and_model(tmp_path, tiny_sd3_path):
    from omniroll.train.report.reward_curve import curve_title
    from omniroll.train.report.tracking import Tracker, model_name

    lines = []
    tracker = Tracker(train_config(tiny_sd3_path, steps=60, logger=["console"]), str(tmp_path), log=lines.append)
    tracker.log_step(STEP)
    tracker.log_step(STEP, total=3)  # the trainer passes train(steps)'s
    assert [ln.split()[1] for ln in lines] == ["1/60", "1/3"]

    cfg = train_config(tiny_sd3_path)
    assert model_name(cfg) == os.path.basename(tiny_sd3_path.rstrip("/"))
    assert model_name(load_config(cfg, overrides=["engine.model=tiny"])) == "tiny"
    assert curve_title([STEP], "stable-diffusion-3.5-medium", "Flow-GRPO") == \
        "Flow-GRPO on stable-diffusion-3.5-medium (omniroll train, synchronous)"
    assert curve_title([{**STEP, "max_staleness": 1, "staleness_max": 1}], "tiny", "DanceGRPO") == \
        "DanceGRPO on tiny (omniroll train, async K=1, staleness max 1)"
    from omniroll.config.algorithms import ALGORITHMS  # each algorithm names itself in its runs' titles

    titles = [spec.title for spec in ALGORITHMS.values()]
    assert ALGORITHMS["flow_grpo"].title == "Flow-GRPO" and ALGORITHMS["nft"].title == "DiffusionNFT"
    assert len(set(titles)) == len(titles) and all(t.strip() == t and t for t in titles)  # one plot title each


def test_swanlab_offline_run_holds_the_scalars_and_a_captioned_image(tmp_path, monkeypatch, tiny_sd3_path):
    """swanlab (offline), read back with swanlab's own DataStoreReader. Not in
    `make test`: swanlab pins protobuf < 7, which would downgrade the suite's protobuf (`pip install
    'omniroll[swanlab]'` runs it)."""
    pytest.importorskip("swanlab")
    from swanlab.proto.swanlab.record.v1.record_pb2 import Record
    from swanlab.sdk.internal.core_python.store import DataStoreReader

    from omniroll.agent_loop.batch import DataBatch
    from omniroll.train.report.tracking import Tracker

    monkeypatch.setenv("SWANLAB_MODE", "offline")
    cfg = train_config(tiny_sd3_path, logger=["swanlab"], log_images_every=1, experiment_name="sw")
    g = torch.Generator().manual_seed(0)
    batch = DataBatch.from_dict(
        tensors={"responses": torch.randint(0, 255, (4, 3, 8, 8), dtype=torch.uint8, generator=g),
                 "rm_scores": torch.tensor([[0.1], [0.2], [0.3], [0.4]])},
        non_tensors={"raw_prompt": ["a blue car"] * 2 + ["a green bird"] * 2, "uid": ["a", "a", "b", "b"]})
    tracker = Tracker(cfg, str(tmp_path), log=lambda s: None)
    tracker.log_step({"step": 1, "reward_mean": 0.25, "clip_frac": 0.5, "staleness_max": 1}, batch)
    run_id = tracker.state(1)["swanlab_run_id"]
    tracker.close()
    (path,) = glob.glob(os.path.join(tmp_path, "swanlog", f"run-*{run_id}", f"run-{run_id}.swanlab"))
    reader = DataStoreReader()
    reader.open(path)
    text = b""
    while (raw := reader.scan()) is not None:
        rec = Record()
        rec.ParseFromString(raw)
        text += str(rec).encode()
    reader.close()
    for key in (b"reward/mean", b"actor/clipfrac", b"async/staleness_max", b"train/samples", b"a blue car | 0.1000"):
        assert key in text, key


def test_a_video_batch_goes_to_tensorboard_as_an_animated_gif(tmp_path, tiny_sd3_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from omniroll.agent_loop.batch import DataBatch
    from omniroll.train.report.tracking import Tracker

    cfg = train_config(tiny_sd3_path, logger=["tensorboard"], log_images_every=2, experiment_name="video")
    g = torch.Generator().manual_seed(0)
    batch = DataBatch.from_dict(
        tensors={"responses": torch.randint(0, 255, (2, 5, 3, 8, 8), dtype=torch.uint8, generator=g),  # [B, T, 3, H, W]
                 "rm_scores": torch.tensor([[0.5], [0.7]])},
        non_tensors={"raw_prompt": ["a blue car", "a green bird"], "uid": ["a", "b"]})
    tracker = Tracker(cfg, str(tmp_path), log=lambda s: None)
    for step in (1, 2):
        tracker.log_step({"step": step, "reward_mean": 0.6}, batch)
    tracker.close()
    tb = EventAccumulator(str(tmp_path / "tensorboard" / "video"), size_guidance={"images": 0, "histograms": 0})
    tb.Reload()
    (video,) = tb.Images("train/samples/1")  # step 2 only: log_images_every=2
    assert video.step == 2 and video.encoded_image_string[:4] == b"GIF8"
    assert [e.step for e in tb.Histograms("reward/hist")] == [1, 2]
    assert not os.path.exists(tmp_path / "metrics.jsonl")  # jsonl not named: no metrics.jsonl


def test_a_tracker_that_cannot_start_its_run_is_one_line_naming_it(tmp_path, monkeypatch, tiny_sd3_path):
    wandb = pytest.importorskip("wandb")
    from omniroll.train.report.tracking import Tracker

    wandb.teardown()  # wandb keeps the settings of an earlier run in this process (offline mode) until torn down
    for var in ("WANDB_API_KEY", "WANDB_DIR", "WANDB_CONFIG_DIR", "NETRC"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.netrc, no wandb settings: online wandb has no login
    monkeypatch.setenv("WANDB_MODE", "online")
    cfg = train_config(tiny_sd3_path, logger=["tensorboard", "wandb"], experiment_name="x")
    with pytest.raises(ValueError, match=r"trainer.logger: wandb could not start its run: .*WANDB_MODE=offline"):
        Tracker(cfg, str(tmp_path / "out"), log=lambda s: None)


def test_the_step_line_shows_how_far_the_update_moved_the_policy():
    from omniroll.train.report.tracking import format_step, tracker_name

    assert "policy_kl" not in format_step(STEP, 3)  # not measured (policy_move_rows 0): not shown
    # the move before the update (approx_kl, 0 with one update per step) and the KL to the base, each its own name
    assert "clip 0.00  akl 0.0e+00  kl 3.0e-03  loss +0.0000" in format_step(STEP, 3)
    line = format_step({**STEP, "policy_kl": 2.5e-5, "post_approx_kl": 1e-4, "post_clip_frac": 0.25}, 3)
    assert "gnorm 0.100  policy_kl 2.5e-05  post_akl 1.0e-04  post_clip 0.25  v0" in line
    assert [tracker_name(k) for k in ("policy_kl", "post_approx_kl", "post_clip_frac", "policy_move_s")] == \
        ["actor/policy_kl", "actor/post_approx_kl", "actor/post_clipfrac", "timing/policy_move_s"]
