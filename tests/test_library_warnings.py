"""Third-party warnings a user cannot act on are silenced (`omniroll.library_warnings`) in every process of a run, and
nothing else is: `omniroll train`, run as a user runs it (its own process, its own local Ray), prints none of them,
in the driver or in the replica / reward actors' logs, nor any error line of Ray's, while omniroll's own lines are
all there (the step line's total is `--steps`, not `trainer.steps`)."""

import glob
import logging
import os
import re
import shutil
import subprocess
import sys
import tempfile

import pytest
import yaml

from omniroll.library_warnings import LOG_RECORDS, silence_library_warnings
from tests.test_train import train_config

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
#: the message as transformers 5.x logs it when torchvision is missing (what LOG_RECORDS must match)
TORCHVISION = ("`CLIPImageProcessor` requires torchvision (not installed); falling back to `CLIPImageProcessorPil` "
               "for backward compatibility. Install torchvision to use the default backend, or import "
               "`CLIPImageProcessorPil` directly to silence this warning.")

#: diffusers 0.42's message when a `WanPipeline` is built with a BERT text encoder (the shapes-video model's)
BERT_TYPES = ("Expected types for text_encoder: (<class 'transformers.models.umt5.modeling_umt5.UMT5EncoderModel'>,), "
              "got <class 'transformers.models.bert.modeling_bert.BertModel'>.")
#: a message each entry drops, as its library logs it
DROPPED = {"transformers.utils.import_utils": TORCHVISION, "diffusers.pipelines.pipeline_utils": BERT_TYPES}


def silenced(text: str) -> list[str]:
    return [line for line in text.splitlines() if any(re.search(p, line) for _, p in LOG_RECORDS)]


def test_only_the_named_records_of_the_named_loggers_are_dropped():
    assert silenced(TORCHVISION) == [TORCHVISION] and silenced(BERT_TYPES) == [BERT_TYPES]
    assert sorted(DROPPED) == sorted(name for name, _ in LOG_RECORDS)
    silence_library_warnings()
    silence_library_warnings()  # idempotent
    seen = []
    handler = logging.Handler()
    handler.emit = lambda record: seen.append(record.getMessage())

    def emit(logger, *messages):
        # at WARNING whatever an earlier test set (`--quiet` turns transformers' verbosity down to errors)
        level, logger.level = logger.level, logging.WARNING
        logger.addHandler(handler)
        try:
            for m in messages:
                logger.warning(m)
        finally:
            logger.removeHandler(handler)
            logger.level = level

    kept = ["`CLIPImageProcessor` is deprecated: a warning the user can act on",
            BERT_TYPES.replace("BertModel", "T5EncoderModel")]  # another encoder than the shapes-video model's
    for name, _ in LOG_RECORDS:
        logger = logging.getLogger(name)
        assert len([f for f in logger.filters if type(f).__module__ == "omniroll.library_warnings"]) == 1
        emit(logger, DROPPED[name], *kept)
    emit(logging.getLogger("transformers.modeling_utils"), TORCHVISION)  # another logger: not filtered
    assert seen == kept + kept + [TORCHVISION]


@pytest.mark.slow  # slow: a training in a subprocess
def test_the_train_command_prints_no_silenced_warning_in_the_driver_or_the_actors(tiny_sd3_path, tmp_path):
    cfg = train_config(tiny_sd3_path, steps=5)
    cfg_file = tmp_path / "train.yaml"
    cfg_file.write_text(yaml.safe_dump(cfg.model_dump(mode="json")))
    ray_tmp = tempfile.mkdtemp(prefix="r", dir="/tmp")  # short: Ray's socket paths live under it
    env = {**os.environ, "RAY_TMPDIR": ray_tmp, "PYTHONPATH": os.pathsep.join(
        p for p in (REPO, os.environ.get("PYTHONPATH")) if p)}
    env.pop("RAY_ADDRESS", None)
    try:
        proc = subprocess.run([sys.executable, "-c", "import sys; from omniroll.cli import main; sys.exit(main())",
                               "train", "--config", str(cfg_file), "--out", str(tmp_path / "run"), "--steps", "2"],
                              env=env, capture_output=True, text=True, timeout=900)
        assert proc.returncode == 0, proc.stderr[-3000:]
        printed = proc.stdout + proc.stderr
        assert silenced(printed) == [], printed
        # no error line of Ray's core worker (it logged one at every start while the agent-loop workers got the
        # replicas' actor handles as constructor arguments: see omniroll.agent_loop.manager.RestartableAgentLoopWorker)
        assert [ln for ln in printed.splitlines() if re.search(r" E \d+ \d+\] ", ln)] == [], printed
        # omniroll's own lines are all there; the total is --steps
        assert [ln.split()[1] for ln in proc.stdout.splitlines() if ln.startswith("step ")] == ["1/2", "2/2"]
        for line in ("Ray: started a local cluster", "validation before (CFG ", "validation after (CFG ",
                     "omniroll train: 2 steps"):
            assert line in proc.stdout, proc.stdout
        logs = {f: open(f, errors="replace").read() for f in glob.glob(os.path.join(ray_tmp, "**", "worker-*.err"),
                                                                       recursive=True)}
        actors = {a for text in logs.values() for a in re.findall(r":actor_name:(\w+)", text)}
        assert {"RolloutReplica", "RewardLoopWorker"} <= actors, sorted(logs)
        assert {f: silenced(text) for f, text in logs.items() if silenced(text)} == {}
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)
