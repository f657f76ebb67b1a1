"""omniroll.config: YAML + overrides -> typed config; errors name the dotted key."""

import os

import pytest

from omniroll.config import ConfigError, OmniRollConfig, load_config


def test_defaults_and_overrides(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("pipeline:\n  height: 64\n  width: 64\nagent:\n  num_workers: 3\nseed: 7\n")
    cfg = load_config(str(p), overrides=["pipeline.num_inference_steps=3", "algo.noise_level=0.5"])
    assert isinstance(cfg, OmniRollConfig)
    assert (cfg.pipeline.height, cfg.pipeline.num_inference_steps, cfg.agent.num_workers, cfg.seed) == (64, 3, 3, 7)
    sp = cfg.sampling_params()
    assert sp["noise_level"] == 0.5 and sp["logprobs"] is True and sp["height"] == 64
    val = cfg.sampling_params(validate=True)
    assert val["noise_level"] == 0.0 and val["logprobs"] is False
    assert load_config(cfg).model_dump() == cfg.model_dump()  # round trip


def test_val_kwargs_overlay():
    cfg = load_config({"val_kwargs": {"pipeline": {"num_inference_steps": 5}, "seed": 1}})
    assert cfg.sampling_params(validate=True)["num_inference_steps"] == 5
    assert cfg.sampling_params()["num_inference_steps"] == 10


@pytest.mark.parametrize("overrides, key", [
    (["pipeline.heigth=64"], "pipeline.heigth"),
    (["pipeline.height=abc"], "pipeline.height"),
    (["replicas.count=0"], "replicas.count"),
    (["agent.on_failure=ignore"], "agent.on_failure"),
    (["engine.dtype=int8"], "engine.dtype"),
    (["bogus=1"], "bogus"),
    (["reward.functions.jpeg.fn=jpeg_compressibility", "reward.functions.jpeg.wieght=2"],
     "reward.functions.jpeg.wieght"),
    (["algo.sde_window_size=50"], "algo"),
    (["val_kwargs.algo.noise_level=-1"], "val_kwargs.algo.noise_level"),
    (["replicas.placement=scatter"], "replicas.placement"),
    (["replicas.resources={CPU: 1}"], "replicas.resources"),
    (["agent.resources={head: 0}"], "agent.resources.head"),
    (["reward.placement=x"], "reward.placement"),
])
def test_bad_values_name_the_key(overrides, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        load_config(None, overrides)


@pytest.mark.parametrize("override, nearest", [
    ("pipeline.heigth=64", "pipeline.height"),
    ("replicas.cout=2", "replicas.count"),
    ("trainer.stepz=3", "trainer.steps"),  # an Optional section
    ("trainer.evaluation.seedz=3", "trainer.evaluation.seeds"),  # two levels down, Optional
    ("trainer.lora.rnak=4", "trainer.lora.rank"),
    ("reward.functions.jpeg.wieght=2", "reward.functions.jpeg.weight"),  # a dict's values
    ("val_kwargs.pipeline.heigth=64", "val_kwargs.pipeline.height"),
    ("trainer.xyzzy=1", None), ("nn=3", "n"), ("bogus=1", None),
])
def test_an_unknown_key_names_the_nearest_key_of_its_section(override, nearest):
    overrides = [override, "reward.functions.jpeg.fn=jpeg_compressibility"]
    if override.startswith("trainer."):
        overrides.append("trainer.prompts=[a red car]")
    with pytest.raises(ConfigError) as e:
        load_config(None, overrides)
    key = override.split("=")[0]
    assert f"{key}: Extra inputs are not permitted" in str(e.value)
    if nearest is None:
        assert "did you mean" not in str(e.value)
    else:
        assert f"{key}: Extra inputs are not permitted (did you mean {nearest}?) (got " in str(e.value)


def test_a_bad_value_is_shown_once():
    with pytest.raises(ConfigError) as e:
        load_config(None, ["engine.max_batch_size=1"])
    assert "engine.max_batch_size: must be an int in [2, 4096]" in str(e.value) and str(e.value).count("got") == 1
    with pytest.raises(ConfigError, match=r"replicas\.count: .* \(got 0\)"):  # pydantic's own message: appended
        load_config(None, ["replicas.count=0"])


def test_bad_sources():
    with pytest.raises(ConfigError, match="not found"):
        load_config("/nonexistent/x.yaml")
    with pytest.raises(ConfigError, match="dotted.key=value"):
        load_config(None, ["pipeline.height"])


def test_each_sampling_field_is_declared_once():
    """The YAML sections take each sampling field's type and bounds from `omniroll.engine.params`, and the SDE types
    and solvers are the sampling layer's own lists."""
    from typing import get_args

    from omniroll.config import AlgoSection, PipelineSection
    from omniroll.engine.params import SamplingParams, SdeType, SolverName
    from omniroll.sampling.sde import SDE_TYPES
    from omniroll.sampling.solvers import SOLVER_NAMES

    assert get_args(SdeType) == SDE_TYPES
    assert get_args(SolverName) == SOLVER_NAMES
    for section in (PipelineSection, AlgoSection):
        for name, field in section.model_fields.items():
            if name in SamplingParams.model_fields:
                mine, theirs = field, SamplingParams.model_fields[name]
                assert (mine.annotation, mine.metadata) == (theirs.annotation, theirs.metadata), name


def test_every_example_config_loads():
    import glob

    root = os.path.join(os.path.dirname(__file__), "..")
    files = sorted(glob.glob(os.path.join(root, "examples", "*.yaml")))
    assert len(files) >= 5
    cwd = os.getcwd()
    os.chdir(root)  # their prompt files are relative to the repository
    try:
        for f in files:
            assert load_config(f) is not None, f
    finally:
        os.chdir(cwd)
