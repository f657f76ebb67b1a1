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


def test_shapes_video_is_the_verified_shipped_checkpoint_or_a_clear_error_saying_how_to_make_it(tmp_path, capsys):
    from omniroll.models import SHIPPED_MODELS, resolve_model
    from omniroll.models.shapes import SUMS_FILE
    from omniroll.models.shapes_video import CHECKPOINT

    assert "shapes-video" in SHIPPED_MODELS
    if os.path.isfile(os.path.join(CHECKPOINT, SUMS_FILE)):  # shipped: it loads like the shapes model
        assert resolve_model("shapes-video") == CHECKPOINT and read_task(CHECKPOINT) == "moving_shapes"
        return
    with pytest.raises(FileNotFoundError) as e:
        resolve_model("shapes-video")
    for words in ("not shipped yet", "make shapes-video-model", "--model out/shapes-video-model/checkpoint"):
        assert words in str(e.value)
    out = tmp_path / "o"
    for cmd in (["eval", "--model", "shapes-video", "--out", str(out)],
                ["generate", "--model", "shapes-video", "--prompt", "a red circle moving left", "--out", str(out)]):
        assert main(cmd) == 2
        err = capsys.readouterr().err
        assert "not shipped yet" in err and "make shapes-video-model" in err
    assert not out.exists()  # refused before any work


def test_install_copies_a_verified_moving_shapes_checkpoint_and_refuses_others(toy_video, tmp_path):
    from omniroll.models import resolve_model
    from omniroll.models.shapes_video import checkpoint_dir, install

    dest = tmp_path / "shipped"
    with pytest.raises(FileNotFoundError, match="not shipped yet"):
        checkpoint_dir(str(dest))
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
