"""DataBatch (DataProto-compatible container) and the agent-loop registry; no Ray needed."""

import numpy as np
import pytest
import torch

from omniroll.agent_loop import DataBatch, get_agent_loop_class, register, registered_names
from omniroll.agent_loop.loop import DiffusionSingleTurnAgentLoop, prompt_text


def batch(n=5):
    return DataBatch.from_dict(tensors={"x": torch.arange(n * 2).view(n, 2)},
                               non_tensors={"uid": [f"u{i}" for i in range(n)], "msgs": [[{"a": i}] for i in range(n)]},
                               meta_info={"global_steps": 3})


def test_chunk_uneven_and_concat_round_trip():
    b = batch(5)
    parts = b.chunk(2)
    assert [len(p) for p in parts] == [3, 2]
    assert [len(p) for p in b.chunk(7)] == [1, 1, 1, 1, 1, 0, 0]
    back = DataBatch.concat(parts)
    assert torch.equal(back.batch["x"], b.batch["x"])
    assert list(back.non_tensor_batch["uid"]) == list(b.non_tensor_batch["uid"])
    assert back.non_tensor_batch["msgs"].shape == (5,) and back.meta_info == {"global_steps": 3}
    assert [len(p) for p in b.split(2)] == [2, 2, 1] and [len(p) for p in b.split([1, 4])] == [1, 4]
    with pytest.raises(ValueError, match="sum to the batch size"):
        b.split([1, 1])


def test_select_index_repeat_union():
    b = batch(4)
    s = b.select(batch_keys=["x"], non_tensor_batch_keys=["uid"])
    assert list(s.batch.keys()) == ["x"] and list(s.non_tensor_batch) == ["uid"]
    with pytest.raises(KeyError, match="nope"):
        b.select(batch_keys=["nope"])
    assert list(b[[3, 0]].non_tensor_batch["uid"]) == ["u3", "u0"] and len(b[np.array([True, False] * 2)]) == 2
    r = b.repeat(2)
    assert list(r.non_tensor_batch["uid"][:4]) == ["u0", "u0", "u1", "u1"]
    extra = DataBatch.from_dict(tensors={"y": torch.zeros(4)})
    assert "y" in b.union(extra).batch.keys()


def test_consistency_and_meta_conflicts():
    with pytest.raises(ValueError, match="different batch sizes"):
        DataBatch.from_dict(tensors={"x": torch.zeros(3)}, non_tensors={"u": [1, 2]})
    a, c = batch(2), batch(2)
    c.meta_info["global_steps"] = 4
    with pytest.raises(ValueError, match="global_steps"):
        DataBatch.concat([a, c])
    a.meta_info["metrics"], c.meta_info = [{"m": 1}], {"metrics": [{"m": 2}], "global_steps": 3}
    assert DataBatch.concat([a, c]).meta_info["metrics"] == [{"m": 1}, {"m": 2}]


def test_registry_and_prompt_text():
    assert get_agent_loop_class("diffusion_single_turn_agent") is DiffusionSingleTurnAgentLoop
    with pytest.raises(KeyError, match="diffusion_single_turn_agent"):
        get_agent_loop_class("unknown")

    @register("my_loop_for_test")
    class Mine:  # noqa: D401
        pass

    assert "my_loop_for_test" in registered_names()
    with pytest.raises(ValueError, match="already registered"):
        register("my_loop_for_test")(DiffusionSingleTurnAgentLoop)
    assert prompt_text([{"role": "user", "content": [{"type": "text", "text": "a cat"}]}]) == "a cat"
    with pytest.raises(ValueError, match="raw_prompt has no message with role 'user'"):
        prompt_text([{"role": "system", "content": "x"}])
    with pytest.raises(ValueError, match="raw_prompt must be"):
        prompt_text(3)


def test_pickles_tensors_as_numpy_bit_exact():
    import pickle

    t = {"responses": torch.randint(0, 255, (3, 3, 4, 4), dtype=torch.uint8), "lp": torch.randn(3, 2),
         "emb": torch.randn(3, 5, 2).bfloat16(), "mask": torch.ones(3, 5, dtype=torch.int64)}
    db = DataBatch.from_dict(t, {"uid": ["a", "b", "c"], "info": [{"x": 1}, {}, {"y": [2]}]}, {"global_steps": 7})
    reduced = db.__reduce__()
    assert all(not isinstance(a, torch.Tensor) for a in reduced[1][0].values())  # tensors leave as numpy
    back = pickle.loads(pickle.dumps(db))
    assert len(back) == 3 and back.meta_info == {"global_steps": 7}
    assert list(back.non_tensor_batch["uid"]) == ["a", "b", "c"] and back.non_tensor_batch["info"][2] == {"y": [2]}
    for k, v in t.items():
        assert back.batch[k].dtype == v.dtype and torch.equal(back.batch[k], v), k


def test_manager_chunks_cut_only_at_group_boundaries():
    from omniroll.agent_loop.manager import group_chunk_sizes

    uids = ["a"] * 4 + ["b"] * 4 + ["c"] * 4  # 12 rows, 3 groups
    assert group_chunk_sizes(uids, 2) == [4, 8]  # the nearer cut to 6 rows; ties go to the earlier cut
    assert group_chunk_sizes(uids, 3) == [4, 4, 4]
    assert sum(group_chunk_sizes(uids, 5)) == 12
    assert group_chunk_sizes(["a", "a", "b", "c", "c"], 2) == [2, 3]  # uneven, never splitting a group
    assert group_chunk_sizes(["a"] * 5, 2) == [5, 0]  # one group stays whole


@pytest.mark.parametrize("override, message", [
    ({"height": 72}, r"meta_info\['sampling_params'\]\.height must be a positive multiple of 16 \(vae_scale_factor x "
                     r"patch_size\), got 72"),
    ({"width": 2048}, r"meta_info\['sampling_params'\]\.width must be <= 1024 \(pos_embed_max_size x 16\), got 2048"),
])
def test_batch_sampling_the_model_refuses_is_refused_where_the_batch_is_planned(tiny_sd3_path, override, message):
    """The engine's own check of resolution and text length (`ModelLimits`, from the checkpoint's files) runs on
    `meta_info["sampling_params"]` when the batch is planned, before any client call; the config's values pass."""
    from omniroll.agent_loop.rows import plan_batch
    from omniroll.config import load_config

    cfg = load_config({"engine": {"model": tiny_sd3_path}, "pipeline": {"height": 64, "width": 64,
                                                                        "max_sequence_length": 16}})
    rows = DataBatch.from_dict(non_tensors={"raw_prompt": ["a cat", "a dog"]},
                               meta_info={"global_steps": 1, "sampling_params": override})
    with pytest.raises(ValueError, match=message):
        plan_batch(cfg, rows)
    rows.meta_info["sampling_params"] = {"height": 32, "width": 48}  # multiples of 16: planned
    assert plan_batch(cfg, rows).base_sampling["width"] == 48
