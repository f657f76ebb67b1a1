"""Row threads (`EngineConfig.row_threads`): a step's rows split among threads at one torch thread each give the
samples of an engine at one torch thread, bitwise; bad settings are refused; a failing share fails its step's
requests only."""

import threading

import pytest
import torch

from omniroll import GenerationRequest, SamplingParams
from omniroll.engine.config import EngineConfig
from omniroll.engine.engine import DiffusionEngine
from omniroll.engine.row_threads import RowThreads

BASE = dict(height=64, width=64, num_inference_steps=4, max_sequence_length=16)


def req(rid, prompt="a photo of a cat", seed=0, **params):
    return GenerationRequest(request_id=rid, prompt=prompt, negative_prompt=None, seed=seed,
                             sampling_params=SamplingParams(**{**BASE, **params}))


def mixed_requests(tag: str) -> list[GenerationRequest]:
    """CFG and not, SDE windows with log-probs, the ODE, a solver, other step counts, a shared latent seed (prefix
    sharing), and an odd count (a decode block padded)."""
    reqs = [req(f"{tag}-cfg{i}", prompt=f"a red car {i % 3}", seed=i) for i in range(5)]
    reqs += [req(f"{tag}-nocfg", seed=7, guidance_scale=1.0),
             req(f"{tag}-ode", seed=8, noise_level=0.0, logprobs=False),
             req(f"{tag}-dpm", seed=9, solver="dpmpp_2m", noise_level=0.0, logprobs=False, num_inference_steps=6),
             req(f"{tag}-cps", seed=10, sde_type="cps", noise_level=0.8, num_inference_steps=6)]
    reqs += [req(f"{tag}-group{i}", prompt="a blue bird", seed=20 + i, latent_seed=5) for i in range(2)]
    return reqs


def test_row_threads_draw_the_one_thread_engines_samples_bitwise(tiny_sd3_path, torch_threads):
    one = DiffusionEngine.from_pretrained(tiny_sd3_path, max_batch_size=32, num_threads=1, batch_invariant=True)
    try:
        expected = one.generate(mixed_requests("one"))
        identity = one.sample_identity()
    finally:
        one.shutdown()
    for n, rows in ((2, 32), (3, 32), (2, 6)):  # 6 rows: steps of a few requests, a share of one request
        eng = DiffusionEngine.from_pretrained(tiny_sd3_path, max_batch_size=rows, row_threads=n, batch_invariant=True)
        try:
            got = eng.generate(mixed_requests(f"rows{n}-{rows}"))
            assert eng.sample_identity() == identity  # so kept evaluations of either serve both
            assert eng.stats()["mean_rows_per_step"] > 2  # steps of several requests, split among the threads
            assert sum(t.name.startswith("omniroll-rows") for t in threading.enumerate()) == n
        finally:
            eng.shutdown()
        for a, b in zip(expected, got, strict=True):
            assert b.stop_reason == "completed"
            assert torch.equal(a.diffusion_output, b.diffusion_output), (n, rows, b.request_id)
            assert torch.equal(a.extra_fields["all_latents"], b.extra_fields["all_latents"])
            assert (a.log_probs is None) == (b.log_probs is None)
            if a.log_probs is not None:
                assert torch.equal(a.log_probs, b.log_probs)


def test_spans_are_contiguous_balanced_and_never_split_a_request():
    threads = RowThreads(2)
    try:
        assert threads.spans([2] * 48) == [(0, 24), (24, 48)]
        assert threads.spans([2]) == [(0, 1)]
        assert threads.spans([1, 2, 2, 1]) == [(0, 2), (2, 4)]
        assert threads.spans([2, 1, 1, 1, 1]) == [(0, 2), (2, 5)]
    finally:
        threads.shutdown()
    threads = RowThreads(3)
    try:
        assert threads.spans([2] * 9) == [(0, 3), (3, 6), (6, 9)]
        assert threads.spans([2, 2]) == [(0, 1), (1, 2)]  # fewer requests than threads: fewer shares
        for rows in ([1] * 7, [2, 1, 2, 2, 1, 1, 2], [4, 1, 1]):
            spans = threads.spans(rows)
            assert spans[0][0] == 0 and spans[-1][1] == len(rows) and len(spans) <= 3
            assert all(a < b for a, b in spans) and all(s[1] == t[0] for s, t in zip(spans, spans[1:]))
    finally:
        threads.shutdown()


@pytest.mark.parametrize("kwargs, match", [
    (dict(row_threads=0), r"row_threads must be an int in \[1, 256\], got 0"),
    (dict(row_threads=True), r"row_threads must be an int in \[1, 256\], got True"),
    (dict(row_threads=2.0), r"row_threads must be an int in \[1, 256\], got 2.0"),
    (dict(row_threads=2, num_threads=2), r"num_threads must be unset or 1 when row_threads > 1"),
])
def test_bad_row_threads_are_refused_naming_the_field(kwargs, match):
    with pytest.raises(ValueError, match=match):
        EngineConfig(**kwargs)


def test_a_failing_share_fails_its_steps_requests_only(tiny_sd3_path, torch_threads, monkeypatch):
    """A forward that raises on a row thread (injected: a kernel failure) fails the requests of that step, naming the
    error; the engine goes on serving, with the same samples as before."""
    eng = DiffusionEngine.from_pretrained(tiny_sd3_path, max_batch_size=32, row_threads=2)
    try:
        before = eng.generate([req("before", seed=3)])[0]
        velocity = eng.adapter.velocity
        calls = {"n": 0}

        def failing_once(*args, **kwargs):
            calls["n"] += 1
            if calls["n"] == 2:
                raise RuntimeError("kernel failed (injected)")
            return velocity(*args, **kwargs)

        monkeypatch.setattr(eng.adapter, "velocity", failing_once)
        with pytest.raises(RuntimeError, match="kernel failed"):
            eng.generate([req(f"hit{i}", seed=i) for i in range(4)])
        monkeypatch.undo()
        after = eng.generate([req("after", seed=3)])[0]
        assert torch.equal(before.diffusion_output, after.diffusion_output)
        assert eng.stats()["running"] == eng.stats()["waiting"] == 0
    finally:
        eng.shutdown()


FAMILY_SIZE = {"flux": dict(height=16, width=16), "qwen-image": dict(height=16, width=16),
               "wan": dict(height=16, width=16, num_frames=5), "wan2.2": dict(height=16, width=16, num_frames=5)}


@pytest.mark.parametrize("family", sorted(FAMILY_SIZE))
def test_every_family_draws_the_same_samples_on_row_threads(family, tmp_path, torch_threads):
    """Each adapter's forward and decode run on two threads at once (the modules shared): the samples are a 1-thread
    engine's, bitwise (Wan 2.2: each step's expert on the threads)."""
    from omniroll.models.tiny import build_tiny

    path = build_tiny(family, str(tmp_path / family), seed=0)
    sp = dict(num_inference_steps=3, max_sequence_length=8, **FAMILY_SIZE[family])
    reqs = [GenerationRequest(request_id=f"{family}{i}", prompt=f"a red cat {i}", seed=i,
                              sampling_params=SamplingParams(**sp, guidance_scale=4.0 if i % 2 else 1.0))
            for i in range(5)]
    outs = []
    for kwargs in (dict(num_threads=1), dict(row_threads=2)):
        eng = DiffusionEngine.from_pretrained(path, max_batch_size=16, batch_invariant=True, **kwargs)
        try:
            outs.append(eng.generate(reqs))
        finally:
            eng.shutdown()
    for a, b in zip(*outs, strict=True):
        assert torch.equal(a.diffusion_output, b.diffusion_output), b.request_id
        assert torch.equal(a.extra_fields["all_latents"], b.extra_fields["all_latents"])
        assert torch.equal(a.log_probs, b.log_probs)
