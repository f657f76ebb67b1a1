"""The rewards the Flow-GRPO papers use: `ocr` (flow_grpo's formula on rapidocr-onnxruntime's PP-OCRv4, rendered
text), and `pickscore` / `clip_score` / `aesthetic` loaded through transformers' CLIP classes from a tiny random CLIP
saved with `save_pretrained` (the real loading code; only the weights are tiny)."""

from __future__ import annotations

import asyncio
import os

import numpy as np
import pytest
import torch
from pydantic import ValidationError

from omniroll.config import ConfigError, load_config
from omniroll.reward import RewardManager, RewardSample, build_scorer
from omniroll.reward.clip import aesthetic_head
from omniroll.reward.ocr import OcrScorer, levenshtein, ocr_reward, target_text

PROJ = 16


# ------------------------------------------------------------------------------------------------ OCR formula
def test_target_is_the_first_quoted_text_normalized():
    assert target_text('a neon sign that says "Open 24 H" and "other"') == "open24h"
    for bad in ("no quotes here", 'one "quote only', 'empty ""', 'blank " "'):
        with pytest.raises(ValueError, match="target"):
            target_text(bad)


def test_levenshtein_by_hand():
    assert levenshtein("kitten", "sitting") == 3
    assert levenshtein("", "abc") == levenshtein("abc", "") == 3
    assert levenshtein("flaw", "lawn") == 2 and levenshtein("same", "same") == 0


def test_ocr_reward_edge_cases_by_hand():
    t = target_text('"Hello World"')  # "helloworld", 10 characters
    assert ocr_reward("HeLLo WoRLD", t) == 1.0  # spaces and case do not count
    assert ocr_reward("xx hello world yy", t) == 1.0  # contained: distance 0
    assert ocr_reward("helo world", t) == pytest.approx(0.9)  # one deletion
    assert ocr_reward("hellow0rld", t) == pytest.approx(0.9)  # one substitution
    assert ocr_reward("", t) == 0.0  # nothing read: distance = len(target)
    assert ocr_reward("a completely different and much longer text", t) == 0.0  # capped at len(target)
    assert ocr_reward(None, t) == 0.0  # an OCR failure


class _Engine:
    """RapidOCR's interface (`engine(img, use_cls=...) -> (lines, elapsed)`) with fixed answers, to test the
    scorer's bookkeeping; the real engine is tested below."""

    def __init__(self, answers):
        self.answers = list(answers)

    def __call__(self, image, use_cls=False):
        answer = self.answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer, 0.0


def _blank(i):
    return RewardSample(f"row{i}", np.full((3, 8, 8), 255, np.uint8), 'say "abc"')


def test_ocr_failure_scores_zero_and_is_counted_and_low_confidence_lines_are_dropped():
    engine = _Engine([[[None, "ab", 0.9], [None, "c", 0.0]], RuntimeError("onnx broke"), None])
    scorer = OcrScorer(engine=engine)
    out = scorer([_blank(0), _blank(1), _blank(2)])
    assert out[0]["score"] == pytest.approx(1 - 1 / 3) and out[0]["text"] == "ab"  # "c" had confidence 0
    assert out[1] == {"score": 0.0, "ocr_failed": 1, "text": ""}
    assert out[2]["score"] == 0.0 and out[2]["ocr_failed"] == 0  # no text found is a score, not a failure
    assert scorer.failures == 1


def test_a_prompt_without_target_fails_its_row_only_naming_it():
    from omniroll.reward import register_scorer

    register_scorer("test_ocr_fixed", lambda: OcrScorer(engine=lambda img, use_cls=False: ([[None, "abc", 1.0]], 0)),
                    overwrite=True)
    good = _blank(0)
    bad = RewardSample("train/s3/u7/1", good.image, "a sign with no quotes")
    results = asyncio.run(RewardManager({"ocr": {"fn": "test_ocr_fixed", "max_retries": 0}}).score([good, bad]))
    assert results[0].status == "ok" and results[0].score == 1.0 and results[0].extra_info["ocr/ocr_failed"] == 0
    assert results[1].status == "failed" and results[1].score is None
    assert "train/s3/u7/1" in results[1].error and "double quotes" in results[1].error


def test_ocr_without_its_package_fails_at_config_load_with_the_pip_command(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "rapidocr_onnxruntime"
                        else real(name, *a))  # as on a machine without the extra
    with pytest.raises(ConfigError, match=r"reward\.functions\.o\.fn: 'ocr' needs rapidocr-onnxruntime.*"
                                          r"pip install 'omniroll\[ocr\]'"):
        load_config({"reward": {"functions": {"o": {"fn": "ocr"}}}})


def _render(text: str, size: int) -> np.ndarray:
    """`text` in black on white, DejaVu Sans (matplotlib ships it) at `size` px, as a CHW uint8 image."""
    import matplotlib
    from PIL import Image, ImageDraw, ImageFont

    font = ImageFont.truetype(os.path.join(matplotlib.get_data_path(), "fonts", "ttf", "DejaVuSans.ttf"), size)
    image = Image.new("RGB", (int(font.getlength(text)) + 2 * size, 3 * size), "white")
    ImageDraw.Draw(image).text((size, size), text, fill="black", font=font)
    return np.asarray(image).transpose(2, 0, 1).copy()


def test_real_ocr_engine_reads_rendered_text():
    scorer = build_scorer("ocr")  # rapidocr-onnxruntime (omniroll[ocr]): its PP-OCRv4 models come in the wheel
    texts = [("Hello World", 20), ("omniroll", 32), ("Open 24h", 44)]
    own = [RewardSample(f"own{i}", _render(t, s), f'a poster that says "{t}"') for i, (t, s) in enumerate(texts)]
    other = RewardSample("other", own[2].image, f'a poster that says "{texts[0][0]}"')
    scores = [r["score"] for r in scorer(own + [other])]
    assert scores[:3] == [1.0, 1.0, 1.0], scores
    assert scores[3] < 0.5, scores
    assert scorer.failures == 0


# ------------------------------------------------------------------------------------------- CLIP-based scorers
@pytest.fixture(scope="module")
def tiny_clip(tmp_path_factory):
    """A tiny random CLIP (transformers' CLIPModel) and its processor, each saved with save_pretrained, plus a random
    LAION-layout aesthetic head for its embedding width."""
    from transformers import CLIPConfig, CLIPImageProcessor, CLIPModel, CLIPProcessor

    from omniroll.models.tiny._common import train_clip_tokenizer

    root = tmp_path_factory.mktemp("tiny-clip")
    tok = train_clip_tokenizer()
    text = dict(vocab_size=len(tok), hidden_size=32, intermediate_size=37, num_hidden_layers=2,
                num_attention_heads=4, max_position_embeddings=77, bos_token_id=tok.bos_token_id,
                eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    vision = dict(hidden_size=32, intermediate_size=37, num_hidden_layers=2, num_attention_heads=4, image_size=32,
                  patch_size=8)
    torch.manual_seed(0)
    CLIPModel(CLIPConfig(text_config=text, vision_config=vision, projection_dim=PROJ)).save_pretrained(root / "model")
    processor = CLIPProcessor(image_processor=CLIPImageProcessor(size={"shortest_edge": 32},
                                                                 crop_size={"height": 32, "width": 32}), tokenizer=tok)
    processor.save_pretrained(root / "processor")
    head = aesthetic_head(PROJ)
    torch.save({f"layers.{k}": v for k, v in head.state_dict().items()}, root / "head.pth")
    return {"model_dir": str(root / "model"), "processor_dir": str(root / "processor"),
            "head_path": str(root / "head.pth"), "root": root}


def _images(n, seed=0, h=40, w=48):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, (3, h, w), dtype=np.uint8) for _ in range(n)]


PROMPTS = ["a red cat", "a blue dog on the grass", "text"]


def _reference_logits(dirs, images, prompts):
    """transformers' own CLIPModel forward: logits_per_image = logit_scale * cos (the diagonal: each pair)."""
    from transformers import CLIPModel, CLIPProcessor

    model = CLIPModel.from_pretrained(dirs["model_dir"]).eval()
    proc = CLIPProcessor.from_pretrained(dirs["processor_dir"])
    inputs = proc(text=prompts, images=[im.transpose(1, 2, 0) for im in images], return_tensors="pt", padding=True)
    with torch.no_grad():
        out = model(**inputs)
    return out.logits_per_image.diagonal().numpy(), out.image_embeds


@pytest.mark.parametrize("fn, divisor", [("pickscore", 26.0), ("clip_score", 30.0)])
def test_pickscore_and_clip_score_are_scaled_cosines(tiny_clip, fn, divisor):
    kwargs = {"model_dir": tiny_clip["model_dir"], "processor_dir": tiny_clip["processor_dir"], "batch_size": 2}
    scorer = build_scorer(fn, kwargs)
    images = _images(3)
    samples = [RewardSample(f"s{i}", im, p) for i, (im, p) in enumerate(zip(images, PROMPTS))]
    got = np.array(scorer(samples))
    logits, _ = _reference_logits(tiny_clip, images, PROMPTS)
    np.testing.assert_allclose(got, logits / divisor, rtol=1e-4, atol=1e-5)
    assert len(set(np.round(got, 6))) == 3  # the prompt and the image matter
    one_by_one = build_scorer(fn, {**kwargs, "batch_size": 1})
    np.testing.assert_allclose(one_by_one(samples), got, rtol=1e-5, atol=1e-6)  # batching changes nothing


def test_aesthetic_is_the_laion_head_on_the_normalized_image_embedding(tiny_clip):
    scorer = build_scorer("aesthetic", {k: tiny_clip[k] for k in ("model_dir", "processor_dir", "head_path")})
    images = _images(2, seed=1)
    got = scorer([RewardSample(f"s{i}", im, "ignored") for i, im in enumerate(images)])
    _, embeds = _reference_logits(tiny_clip, images, ["x", "y"])  # CLIPModel's image_embeds are L2-normalized
    head = aesthetic_head(PROJ)
    head.load_state_dict({k.removeprefix("layers."): v for k, v in torch.load(tiny_clip["head_path"]).items()})
    with torch.no_grad():
        want = head.eval()(embeds).squeeze(-1).numpy()
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
    video = RewardSample("v", np.stack(images), "ignored")  # a video scores its frames' mean
    assert scorer([video])[0] == pytest.approx(float(np.mean(want)), rel=1e-4)


def test_weighted_combination_with_existing_scorers_keeps_each_score(tiny_clip):
    config = {"pick": {"fn": "pickscore", "weight": 0.5,
                       "kwargs": {"model_dir": tiny_clip["model_dir"], "processor_dir": tiny_clip["processor_dir"]}},
              "jpeg": {"fn": "jpeg_compressibility", "weight": 2.0}}
    samples = [RewardSample(f"s{i}", im, p) for i, (im, p) in enumerate(zip(_images(2, 3), PROMPTS))]
    results = asyncio.run(RewardManager(config).score(samples))
    for r in results:
        assert r.status == "ok" and set(r.components) == {"pick", "jpeg"}
        assert r.score == pytest.approx(0.5 * r.components["pick"] + 2.0 * r.components["jpeg"])


def _config_error(fn, kwargs) -> str:
    with pytest.raises(ConfigError) as e:
        load_config({"reward": {"functions": {"r": {"fn": fn, "kwargs": kwargs}}}})
    return str(e.value)


def test_missing_or_wrong_directories_are_one_line_naming_key_and_path(tiny_clip, tmp_path):
    good = {k: tiny_clip[k] for k in ("model_dir", "processor_dir")}
    missing = str(tmp_path / "nope")
    msg = _config_error("pickscore", {**good, "model_dir": missing})
    assert "reward.functions.r" in msg and "kwargs.model_dir" in msg and missing in msg and "\n" not in msg
    msg = _config_error("clip_score", {**good, "model_dir": good["processor_dir"]})  # a processor, not a model
    assert "kwargs.model_dir" in msg and good["processor_dir"] in msg and "config.json" in msg
    (tmp_path / "bert").mkdir()
    (tmp_path / "bert" / "config.json").write_text('{"model_type": "bert"}')
    msg = _config_error("clip_score", {**good, "model_dir": str(tmp_path / "bert")})
    assert "kwargs.model_dir" in msg and "'bert'" in msg and "CLIP" in msg
    msg = _config_error("pickscore", {**good, "processor_dir": tiny_clip["model_dir"]})
    assert "kwargs.processor_dir" in msg and "preprocessor_config.json" in msg
    msg = _config_error("aesthetic", {**good, "head_path": missing})
    assert "kwargs.head_path" in msg and missing in msg
    msg = _config_error("aesthetic", good)
    assert "kwargs: missing a required argument: 'head_path'" in msg
    # a head made for another embedding width, found when the scorer loads it
    torch.save(aesthetic_head(PROJ + 1).state_dict(), tmp_path / "wide.pth")
    with pytest.raises(ValueError, match=r"kwargs\.head_path: .*wide\.pth.* 17-wide .* projects to 16"):
        build_scorer("aesthetic", {**good, "head_path": str(tmp_path / "wide.pth")})


def test_model_loading_takes_device_and_dtype(tiny_clip):
    scorer = build_scorer("clip_score", {"model_dir": tiny_clip["model_dir"], "processor_dir": tiny_clip[
        "processor_dir"], "device": "cpu", "dtype": "bfloat16"})
    assert scorer.model.dtype == torch.bfloat16 and scorer.model.device.type == "cpu"
    assert np.isfinite(scorer([RewardSample("s", _images(1)[0], "a cat")])).all()
    with pytest.raises(ValidationError, match=r"kwargs\.dtype: must be one of"):
        RewardManager({"c": {"fn": "clip_score", "kwargs": {"model_dir": tiny_clip["model_dir"], "dtype": "int8"}}})
