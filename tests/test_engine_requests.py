"""A bad request never hurts another (engine level): prompts checked at the boundary, encoded one by one in their own
guard, duplicate request ids refused, outputs that never alias the engine's prompt cache."""

import pytest
import torch
from pydantic import ValidationError

from omniroll import GenerationRequest, SamplingParams
from omniroll.engine.config import EngineConfig
from omniroll.engine.engine import DiffusionEngine
from omniroll.engine.errors import RequestError

SP = SamplingParams(height=64, width=64, num_inference_steps=3, max_sequence_length=16)


def req(rid, prompt="a photo of a cat", seed=0, negative=None, sp=SP):
    return GenerationRequest(request_id=rid, prompt=prompt, negative_prompt=negative, seed=seed, sampling_params=sp)


@pytest.fixture(scope="module")
def engine(tiny_sd3_path):
    eng = DiffusionEngine.from_pretrained(tiny_sd3_path, max_batch_size=16, max_prompt_chars=64)
    yield eng
    eng.shutdown()


def test_prompt_must_be_encodable_text():
    for field in ("prompt", "negative_prompt"):
        kw = {"prompt": "a cat", field: "a \ud800 cat"}  # what a JSON "\ud800" escape decodes to
        with pytest.raises(ValidationError, match=rf"{field}[\s\S]*U\+D800 at position 2") as ei:
            GenerationRequest(request_id="r", seed=0, **kw)
        assert "a \\ud800 cat" not in str(ei.value).split("input_value")[0]  # the reason does not echo the text
    GenerationRequest(request_id="r", seed=0, prompt="un chat \u00e9t\u00e9 \U0001f431")  # any valid text is fine
    assert EngineConfig().max_prompt_chars == 8192
    with pytest.raises(ValueError, match="max_prompt_chars"):
        EngineConfig(max_prompt_chars=0)


def test_too_long_prompt_is_refused_before_encoding(engine):
    with pytest.raises(RequestError, match=r"'long'.*prompt has 65 characters, more than max_prompt_chars=64") as ei:
        engine.generate([req("ok0"), req("long", prompt="x" * 65)])
    assert ei.value.request_id == "long" and isinstance(ei.value, ValueError)
    with pytest.raises(RequestError, match="negative_prompt has 100 characters"):
        engine.generate([req("longneg", negative="y" * 100)])
    assert engine.stats()["running"] == engine.stats()["waiting"] == 0  # nothing of the refused call was queued
    assert engine.generate([req("ok1")])[0].stop_reason == "completed"


def test_a_prompt_that_fails_to_encode_fails_alone(engine):
    """A request that got past the boundary (model_construct skips validation, as a new entry point might) with a
    prompt the tokenizer refuses: only it fails, naming its id, field and reason; the others of the same step run."""
    bad = GenerationRequest.model_construct(request_id="bad", prompt="a \ud800 cat", negative_prompt=None,
                                            sampling_params=SP, seed=1)
    badneg = GenerationRequest.model_construct(request_id="badneg", prompt="a dog", negative_prompt="\udfff",
                                               sampling_params=SP, seed=2)
    good = [req(f"g{i}", prompt=p, seed=i) for i, p in enumerate(["a red car", "a dog", "a red car"])]
    futures = engine._submit_futures([good[0], bad, good[1], badneg, good[2]])  # admitted in one step
    with pytest.raises(RequestError, match=r"'bad'.*prompt could not be encoded") as ei:
        futures[1].result(timeout=120)
    assert ei.value.request_id == "bad"
    with pytest.raises(RequestError, match=r"'badneg'.*negative_prompt could not be encoded"):
        futures[3].result(timeout=120)
    outs = [futures[i].result(timeout=120) for i in (0, 2, 4)]
    assert [o.stop_reason for o in outs] == ["completed"] * 3
    assert ("a \ud800 cat", 16) not in engine.prompt_cache._cache  # a failure is never cached
    # the same requests alone give the same samples: the failures did not disturb them
    alone = engine.generate([req("g0b", prompt="a red car", seed=0)])[0]
    assert torch.equal(alone.diffusion_output, outs[0].diffusion_output)


def test_duplicate_request_ids_in_flight_are_refused(engine):
    long_sp = SP.model_copy(update={"num_inference_steps": 400})
    first = engine._submit_futures([req("dup", sp=long_sp)])[0]
    with pytest.raises(RequestError, match="'dup'.*already in flight"):
        engine.generate([req("dup", seed=5)])
    with pytest.raises(RequestError, match="'twice'.*already in flight"):
        engine.generate([req("twice"), req("twice", seed=1)])
    assert engine.abort("dup") is True  # names exactly one request
    assert first.result(timeout=60).stop_reason == "aborted"
    assert engine.generate([req("dup"), req("twice")])[1].stop_reason == "completed"  # ids are free again


def test_outputs_do_not_alias_the_prompt_cache(engine):
    before = engine.generate([req("a1", prompt="a blue bird", seed=3)])[0]
    kept = {k: v.clone() for k, v in before.extra_fields.items() if isinstance(v, torch.Tensor)}
    pixels = before.diffusion_output.clone()
    for k in ("prompt_embeds", "pooled_prompt_embeds", "negative_prompt_embeds", "negative_pooled_prompt_embeds"):
        before.extra_fields[k].mul_(0).add_(7)  # a trainer normalising in place
    after = engine.generate([req("a2", prompt="a blue bird", seed=3)])[0]
    assert torch.equal(after.diffusion_output, pixels)
    for k in ("prompt_embeds", "negative_pooled_prompt_embeds", "all_latents"):
        assert torch.equal(after.extra_fields[k], kept[k]), k


def test_a_queued_request_holds_no_latent_and_the_queue_is_bounded(tiny_sd3_path):
    """While nothing can start (the step pause holds the loop), queued requests are checked but hold no latent,
    generator or window (built at admission); a call that would make more than max_waiting wait is refused whole,
    naming the key, and nothing of it is queued. Once the queue moves, the queued requests give the samples they give
    on an engine that admits them at once."""
    from omniroll.engine.errors import EngineOverloadedError

    eng = DiffusionEngine.from_pretrained(tiny_sd3_path, max_batch_size=16, max_waiting=3)
    try:
        eng.pause_generation(after_steps=0, timeout_s=120)
        futures = eng._submit_futures([req("q0", seed=0), req("q1", prompt="a dog", seed=1)])
        with pytest.raises(EngineOverloadedError, match=r"2 request\(s\) wait to start and 2 more would pass "
                                                        r"max_waiting=3 \(engine.max_waiting\); nothing of this call"):
            eng._submit_futures([req("q2"), req("q3")])
        assert eng.stats()["waiting"] == 2
        queued = eng.call_between_steps(lambda: list(eng.scheduler.waiting), op="test")
        assert [s.request_id for s in queued] == ["q0", "q1"]
        assert all(not s.started and s.latents is None and s.generator is None for s in queued)
        eng.resume_generation()
        got = [f.result(timeout=120) for f in futures]
    finally:
        eng.shutdown()
    ref = DiffusionEngine.from_pretrained(tiny_sd3_path, max_batch_size=16)
    try:
        want = ref.generate([req("q0", seed=0), req("q1", prompt="a dog", seed=1)])
    finally:
        ref.shutdown()
    for g, w in zip(got, want):
        assert torch.equal(g.diffusion_output, w.diffusion_output) and torch.equal(g.log_probs, w.log_probs)
    with pytest.raises(ValueError, match="max_waiting must be an int >= 1"):
        EngineConfig(max_waiting=0)
