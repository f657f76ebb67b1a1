"""Seeds under a trainer's chunking: a row's index in its group comes from `_rollout_seed_global_idx` (never from its
position in a chunk), and VeRL-Omni's shared validation seed as an option."""

import numpy as np
import pytest

from omniroll.agent_loop.batch import DataBatch
from omniroll.agent_loop.worker import DiffusionAgentLoopWorker
from omniroll.config import load_config

N = 4  # samples per prompt


def trainer_batch(prompts=2, n=N, **meta):
    """Built like VeRL-Omni's trainer: uid per prompt, n-fold interleaved repeat, then the global row index."""
    base = DataBatch.from_dict(non_tensors={"uid": [f"u{i}" for i in range(prompts)],
                                            "raw_prompt": [f"prompt {i}" for i in range(prompts)]},
                               meta_info={"global_steps": 3, **meta})
    rep = base.repeat(n, interleave=True)
    rep.non_tensor_batch["_rollout_seed_global_idx"] = np.arange(len(rep), dtype=np.int64).astype(object)
    return rep


def worker(**over):
    return DiffusionAgentLoopWorker(load_config({"n": N, "seed": 5, **over}), llm_client=None)


def seeds(w, batch):
    return [r["seed"] for r in w.plan(batch)]


@pytest.mark.parametrize("chunks", [2, 4, 8])
def test_equal_chunking_keeps_every_seed_of_the_whole_batch(chunks):
    w, batch = worker(), trainer_batch()
    whole = seeds(w, batch)
    assert len(set(whole)) == len(whole)  # no two rows (of a group or not) share a seed
    chunked = [s for part in batch.chunk(chunks) for s in seeds(w, part)]
    assert chunked == whole


def test_group_index_is_global_index_mod_n():
    rows = worker().plan(trainer_batch()[[5, 6]])
    assert [(r["uid"], r["_group_index"]) for r in rows] == [("u1", 1), ("u1", 2)]


def test_wrong_group_size_is_refused_not_a_duplicate_seed():
    with pytest.raises(ValueError, match=r"same \(uid, _group_index\).*n = 2"):
        worker(n=2).plan(trainer_batch())


def test_validation_seed_modes():
    batch = trainer_batch(validate=True)
    per_row = seeds(worker(val_kwargs={"n": N, "seed": 11}), batch)
    assert len(set(per_row)) == len(per_row)
    shared = seeds(worker(val_kwargs={"n": N, "seed": 11, "seed_mode": "shared"}), batch)
    assert shared == [11] * len(batch)  # VeRL-Omni: one val_kwargs.seed for every row


def test_trees_on_several_weight_versions_are_found():
    """The worker runs again, whole, a tree whose leaves recorded different weight versions (and fails its rows if
    that happens twice): which trees those are."""
    from omniroll.agent_loop.output_batch import RowResult
    from omniroll.agent_loop.outputs import AgentLoopMetrics, DiffusionAgentLoopOutput
    from omniroll.agent_loop.worker import trees_on_several_versions

    def result(i, first, steps):
        out = DiffusionAgentLoopOutput(prompt_ids=[], response_diffusion_output=None, metrics=AgentLoopMetrics(),
                                       extra_fields={"weight_version": first, "step_weight_versions": steps})
        return RowResult(index=i, request_id=f"r{i}", seed=i, out=out)

    rows = [{"uid": u} for u in ("a", "a", "b", "b", "c", "c")]
    results = {0: result(0, 3, [3, 3]), 1: result(1, 3, [3, 3]),  # one version
               2: result(2, 3, [3, 3]), 3: result(3, 4, [4, 4]),  # a weight update between the two leaves
               4: result(4, 3, [3, 4]), 5: RowResult(index=5, request_id="r5", seed=5, error="failed")}
    assert trees_on_several_versions(results, rows) == {"b": ([2, 3], [(3, (3, 3)), (4, (4, 4))])}
