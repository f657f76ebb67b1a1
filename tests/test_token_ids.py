"""Prompts as per-encoder token ids (what VeRL-Omni's agent loop sends): bitwise the text path, cached by ids, bad ids
refused before any work."""

import pytest
import torch
from pydantic import ValidationError

from omniroll import GenerationRequest, SamplingParams
from omniroll.engine.engine import DiffusionEngine

PARAMS = SamplingParams(height=64, width=64, num_inference_steps=3, max_sequence_length=16, guidance_scale=4.5,
                        sde_window_size=2)
TEXT = 'A Photo of the "OCR" text: Hello-World 42!'  # decoding CLIP ids back to text would lose case and spacing


@pytest.fixture(scope="module")
def engine(tiny_sd3_path):
    eng = DiffusionEngine.from_pretrained(tiny_sd3_path, max_batch_size=4)
    yield eng
    eng.shutdown()


def test_token_ids_give_the_text_paths_sample_bitwise(engine):
    ids = engine.adapter.tokenize(TEXT, PARAMS.max_sequence_length)
    neg_ids = engine.adapter.tokenize("blurry", PARAMS.max_sequence_length)
    assert set(ids) == {"clip", "t5"}  # the tiny model's two CLIP tokenizers share a vocabulary, like SD3's
    text_out, ids_out = engine.generate([
        GenerationRequest(request_id="text", prompt=TEXT, negative_prompt="blurry", seed=7, sampling_params=PARAMS),
        GenerationRequest(request_id="ids", prompt_token_ids=ids, negative_prompt_token_ids=neg_ids, seed=7,
                          sampling_params=PARAMS),
    ])
    assert torch.equal(text_out.diffusion_output, ids_out.diffusion_output)
    assert torch.equal(text_out.log_probs, ids_out.log_probs)
    for key in ("all_latents", "prompt_embeds", "pooled_prompt_embeds", "negative_prompt_embeds",
                "negative_pooled_prompt_embeds"):
        assert torch.equal(text_out.extra_fields[key], ids_out.extra_fields[key]), key
    assert text_out.extra_fields["prompt_ids"] == ids_out.extra_fields["prompt_ids"]
    # The lossy round trip this replaces: decoding the CLIP ids does not give the text back.
    assert engine.adapter.tokenizer.decode(ids["clip"], skip_special_tokens=True) != TEXT


def test_token_ids_are_cached_by_ids(engine):
    ids = engine.adapter.tokenize("a red car", PARAMS.max_sequence_length)
    engine.generate([GenerationRequest(request_id="c0", prompt_token_ids=ids, seed=0, sampling_params=PARAMS)])
    hits, misses = engine.prompt_cache.hits, engine.prompt_cache.misses
    engine.generate([GenerationRequest(request_id=f"c{i}", prompt_token_ids=ids, seed=i, sampling_params=PARAMS)
                     for i in range(1, 3)])
    assert engine.prompt_cache.misses == misses  # prompt ids and the empty negative prompt: both cached
    assert engine.prompt_cache.hits == hits + 4


@pytest.mark.parametrize("ids, message", [
    ({"clip": [1, 2]}, "must have the keys ['clip', 't5']"),
    ({"clip": [1], "t5": [1], "bert": [1]}, "must have the keys"),
    ({"clip": [10**6], "t5": [1]}, "prompt_token_ids.clip: token ids must be ints in [0,"),
    ({"clip": [1] * 78, "t5": [1]}, "prompt_token_ids.clip must be a list of 1 to 77 token ids"),
    ({"clip": [1], "t5": [1] * 17}, "prompt_token_ids.t5 must be a list of 1 to 16 token ids (max_sequence_length)"),
    ({"clip": [], "t5": [1]}, "prompt_token_ids.clip must be a list of 1 to 77"),
])
def test_bad_token_ids_are_refused_before_any_work(engine, ids, message):
    served = engine.served
    with pytest.raises(ValueError) as e:
        engine.generate([GenerationRequest(request_id="bad", prompt_token_ids=ids, seed=0, sampling_params=PARAMS)])
    assert message in str(e.value)
    assert engine.served == served


def test_exactly_one_of_text_and_ids():
    with pytest.raises(ValidationError, match="exactly one of prompt"):
        GenerationRequest(request_id="r", prompt="x", prompt_token_ids={"clip": [1]}, seed=0)
    with pytest.raises(ValidationError, match="exactly one of prompt"):
        GenerationRequest(request_id="r", seed=0)
    with pytest.raises(ValidationError, match="at most one of negative_prompt"):
        GenerationRequest(request_id="r", prompt="x", negative_prompt="y", negative_prompt_token_ids={"clip": [1]},
                          seed=0)
