"""Tree rollouts in the engine (engine/tree.py, engine/prefix_tree.py): every leaf of a tree is bitwise the same
request run alone (at every level, with CFG, an SDE window and dpmpp_2m outside it), each node's steps run once, a
failed prefix fails its subtree, a tree is admitted on one weight version, and bad trees are refused naming the
field."""

import asyncio

import pytest
import torch

from omniroll import GenerationRequest, SamplingParams
from omniroll.engine.engine import DiffusionEngine
from omniroll.engine.errors import EngineError
from omniroll.engine.request import RequestState
from omniroll.engine.scheduler import Scheduler
from omniroll.engine.tree import TreeSpec, check_tree, tree_requests

BASE = dict(height=32, width=32, max_sequence_length=16, guidance_scale=4.5, noise_level=0.8)
#: T = 10, a window of 5 drawn in [2, 8): its start is 2 or 3, steps 3-6 are in every window; dpmpp_2m before and
#: after it
WINDOWED = dict(num_inference_steps=10, sde_window_size=5, sde_window_range=(2, 8), solver="dpmpp_2m")


def params(**kw):
    return SamplingParams(**{**BASE, **WINDOWED, **kw})


def same(a, b):
    assert a.stop_reason == b.stop_reason == "completed"
    assert torch.equal(a.diffusion_output, b.diffusion_output)
    for k in ("all_latents", "sigmas", "sigmas_next", "step_indices", "all_timesteps"):
        assert torch.equal(a.extra_fields[k], b.extra_fields[k]), k
    assert a.log_probs.dtype == torch.float32 and torch.equal(a.log_probs, b.log_probs)
    assert a.extra_fields["sde_window"] == b.extra_fields["sde_window"]


def expected_saved(tree: TreeSpec) -> int:
    """Steps the leaves do not run themselves: N leaves x (the fork each takes), one child per node computing on."""
    saved, nodes = 0, 1
    for f, w in zip(tree.fork_steps, tree.widths):
        saved += nodes * (w - 1) * f  # at each node, every child but the first takes the node's latent at f
        nodes *= w
    return saved


@pytest.mark.parametrize("widths,forks,kw", [
    ((2, 4), (3, 5), {}),  # 8 leaves over two levels, dpmpp_2m outside the window, CFG
    ((4, 2), (3, 6), {"guidance_scale": 1.0, "sde_type": "cps"}),  # no CFG, another SDE
    ((2, 2, 2), (3, 4, 6), {"solver": "euler"}),  # three levels
])
def test_every_leaf_is_bitwise_its_unshared_run(engine, alone, widths, forks, kw):
    tree = TreeSpec(fork_steps=forks, widths=widths)
    reqs = tree_requests(tree, params(**kw), seed=11, id_prefix="t", prompt="a green frog")
    saved0, rows0 = engine.stats()["prefix_steps_saved"], engine.rows_run
    outs = engine.generate(reqs)
    assert engine.stats()["prefix_steps_saved"] - saved0 == expected_saved(tree)
    T, rows = 10, 1 if kw.get("guidance_scale") == 1.0 else 2
    assert engine.rows_run - rows0 == rows * (T * tree.leaves - expected_saved(tree))
    start = outs[0].extra_fields["sde_window"][0]
    for r, o in zip(reqs, outs):
        same(alone(r), o)
        assert o.extra_fields["sde_window"][0] == start
    # siblings: the same recorded steps before their fork, other noise from it on
    paths = tree.leaf_paths()
    for i, j in [(0, 1), (0, len(paths) - 1)]:
        d = next(k for k in range(len(forks)) if paths[i][k] != paths[j][k])  # the fork where they part
        a, b = outs[i].extra_fields["all_latents"], outs[j].extra_fields["all_latents"]
        split = forks[d] - start + 1  # all_latents[k] is the latent after window step start + k - 1
        assert torch.equal(a[:split], b[:split]) and not torch.equal(a[split], b[split])


def test_a_leaf_runs_alone_as_an_ordinary_request(engine, alone):
    """The unshared equivalent is expressible: the same noise path written out by hand."""
    tree = TreeSpec(fork_steps=(3, 5), widths=(2, 2))
    reqs = tree_requests(tree, params(), seed=5, id_prefix="u", prompt="a red car")
    r = reqs[3]
    by_hand = GenerationRequest(request_id="by-hand", prompt="a red car", seed=r.seed, sampling_params=SamplingParams(
        **{**BASE, **WINDOWED, "latent_seed": r.sampling_params.latent_seed,
           "noise_seeds": [list(p) for p in r.sampling_params.noise_seeds]}))
    outs = engine.generate(reqs)
    same(alone(by_hand), outs[3])
    assert outs[3].extra_fields["sampling_params"]["noise_seeds"] == [list(p) for p in r.sampling_params.noise_seeds]
    assert [q.request_id for q in reqs] == ["u/0.0", "u/0.1", "u/1.0", "u/1.1"]


def test_an_aborted_leader_hands_over_and_every_other_leaf_stays_bitwise(engine, alone):
    tree = TreeSpec(fork_steps=(22, 26), widths=(2, 2))
    p = SamplingParams(**{**BASE, "num_inference_steps": 30, "sde_window_size": 8, "sde_window_range": (20, 30)})
    reqs = tree_requests(tree, p, seed=3, id_prefix="ab", prompt="a blue bird")

    async def run():
        tasks = [asyncio.create_task(engine.generate_async(r)) for r in reqs]
        while not any(s.request_id == "ab/0.0" and s.step_index >= 24 for s in engine.scheduler.running):
            await asyncio.sleep(0.001)  # the leader is inside the second level's prefix, past the first fork
        assert await asyncio.to_thread(engine.abort, "ab/0.0") is True
        return await asyncio.gather(*tasks)

    outs = asyncio.run(run())
    assert outs[0].stop_reason == "aborted"
    for r, o in zip(reqs[1:], outs[1:]):
        same(alone(r), o)


def test_a_failed_prefix_fails_its_subtree_and_a_failed_leaf_fails_alone(engine):
    tree = TreeSpec(fork_steps=(3, 5), widths=(2, 2))
    reqs = tree_requests(tree, params(), seed=9, id_prefix="f", prompt="a red car")
    boom = RuntimeError("boom")

    def fail(rid):
        state = next(s for s in engine.scheduler.running if s.request_id == rid)
        engine.completion.fail([state], boom)

    async def run(rid, after):
        engine.pause_generation(after_steps=after)
        tasks = [asyncio.create_task(engine.generate_async(r)) for r in reqs]
        await asyncio.to_thread(engine.wait_for_pause)
        await asyncio.to_thread(engine.call_between_steps, lambda: fail(rid))
        engine.resume_generation()
        return await asyncio.gather(*tasks, return_exceptions=True)

    # the root's leader fails at step 2, inside the shared prefix: every leaf fails, each naming it
    outs = asyncio.run(run("f/0.0", 2))
    assert all(isinstance(o, EngineError) for o in outs)
    assert "boom" in str(outs[0])
    for o in outs[1:]:
        assert "shared prefix" in str(o) and "f/0.0" in str(o) and "boom" in str(o)
    # leaf 1.0 (a second-level leader after the first fork) fails at step 4: its sibling 1.1 with it, the others not
    outs = asyncio.run(run("f/1.0", 4))  # 3 steps to the first fork, one more: 1.0 at step 4, its fork at 5
    assert [type(o).__name__ for o in outs] == ["DiffusionOutput", "DiffusionOutput", "EngineError", "EngineError"]
    assert "f/1.0" in str(outs[3])
    # a leaf after its last fork fails alone
    outs = asyncio.run(run("f/0.1", 8))
    assert [isinstance(o, EngineError) for o in outs] == [False, True, False, False]


def test_a_tree_is_admitted_whole_on_one_weight_version(tiny_sd3_path):
    tree = TreeSpec(fork_steps=(3, 5), widths=(2, 2))
    reqs = tree_requests(tree, params(), seed=2, id_prefix="v", prompt="a red car")  # 4 CFG leaves: 8 rows
    sched = Scheduler(max_batch_size=9)
    other = RequestState(GenerationRequest(request_id="o", prompt="x", seed=1, sampling_params=params()),
                         torch.linspace(1, 0, 11), (1, 2, 2), on_done=lambda o, e: None)
    sched.add(other)
    for r in reqs:
        sched.add(RequestState(r, torch.linspace(1, 0, 11), (1, 2, 2), on_done=lambda o, e: None))
    assert [s.request_id for s in sched.admit()] == ["o"]  # 2 + 8 rows > 9: the tree waits whole (3 leaves fit)
    sched.finish(list(sched.running))
    assert [s.request_id for s in sched.admit()] == [r.request_id for r in reqs]
    eng = DiffusionEngine.from_pretrained(tiny_sd3_path, max_batch_size=9)
    try:
        outs = eng.generate([other.request] + reqs)
        assert {o.extra_fields["weight_version"] for o in outs[1:]} == {0}
    finally:
        eng.shutdown()


@pytest.mark.parametrize("tree,kw,n,field", [
    (dict(fork_steps=(3, 5), widths=(2, 4)), {}, 6, "tree.widths:"),  # 8 leaves for a group of 6
    (dict(fork_steps=(3, 12), widths=(2, 2)), dict(num_inference_steps=10, sde_window_size=None, sde_window_range=None),
     4, "tree.fork_steps[1]: step 12 is outside the schedule"),
    # not in every window (a window starts at 2 or 3, so it covers steps 3-6 in every draw)
    (dict(fork_steps=(3, 7), widths=(2, 2)), {}, 4, "tree.fork_steps[1]: step 7 is outside the SDE window"),
    (dict(fork_steps=(2, 4), widths=(2, 2)), {}, 4, "tree.fork_steps[0]: step 2 is outside the SDE window"),
    # an ODE: no noise differs
    (dict(fork_steps=(3, 5), widths=(2, 2)), dict(noise_level=0.0), 4, "tree: the sampling is an ODE"),
    (dict(fork_steps=(3, 5), widths=(2, 2)), dict(sde_type="ode"), 4, "tree: the sampling is an ODE"),
])
def test_bad_trees_are_refused_naming_the_field(tree, kw, n, field):
    with pytest.raises(ValueError, match=field.replace("[", r"\[").replace("]", r"\]")):
        check_tree(TreeSpec(**tree), params(**kw), n)


@pytest.mark.parametrize("tree,field", [
    (dict(fork_steps=(5, 3), widths=(2, 2)), "fork_steps must be strictly increasing"),
    (dict(fork_steps=(3, 3), widths=(2, 2)), "fork_steps must be strictly increasing"),
    (dict(fork_steps=(0,), widths=(2,)), r"fork_steps\[0\] must be >= 1"),
    (dict(fork_steps=(3,), widths=(1,)), r"widths\[0\] must be >= 2"),
    (dict(fork_steps=(3, 4), widths=(2,)), "widths: one width per fork step"),
    (dict(fork_steps=(), widths=()), "fork_steps"),
])
def test_malformed_trees_are_refused_naming_the_field(tree, field):
    with pytest.raises(ValueError, match=field):
        TreeSpec(**tree)


def test_noise_seeds_are_validated():
    for bad, msg in (([[0, 1]], r"noise_seeds\[0\] step"), ([[4, 1], [4, 2]], r"noise_seeds\[1\] step"),
                     ([[10, 1]], r"noise_seeds\[0\] step"), ([[2, -1]], r"noise_seeds\[0\] seed")):
        with pytest.raises(ValueError, match=msg):
            SamplingParams(num_inference_steps=10, noise_seeds=bad)
