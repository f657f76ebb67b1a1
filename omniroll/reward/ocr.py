"""`ocr`: flow_grpo's text-rendering reward, with an OCR engine that works offline from a pip package.

The formula is flow_grpo's (`flow_grpo/ocr.py`), unchanged:

- target = the text between the first pair of double quotes in the prompt (`a sign that says "Open 24h"` -> `Open 24h`);
- the OCR'd text = every recognized line with confidence > 0, joined without separator;
- spaces are removed from both and both are lower-cased;
- distance = 0 when the target is contained in the OCR'd text, else their Levenshtein distance, capped at len(target);
- reward = 1 - distance / len(target), in [0, 1].

An OCR failure (the engine raises on an image) scores distance = len(target), i.e. 0, as in flow_grpo, and is counted:
the row's `ocr/ocr_failed` extra is 1 and `OcrScorer.failures` grows. A prompt without a quoted target (or with an
empty one) is an error of that row, naming it (never a silent 0 nor a division by zero); the other rows are scored.

Engine: `rapidocr-onnxruntime` (`pip install 'omniroll[ocr]'`), which ships PP-OCRv4 detection / recognition ONNX
models inside its wheel, so nothing is downloaded. flow_grpo runs PaddleOCR 2.9 (`lang="en"`): its recognizer is a
different model, so scores are close to but not bit-identical with flow_grpo's.
"""

from __future__ import annotations

import re
import threading
from typing import Any, Optional

import numpy as np

_QUOTED = re.compile(r'"([^"]*)"')
INSTALL_HINT = "pip install 'omniroll[ocr]'  (rapidocr-onnxruntime: PP-OCRv4 ONNX models inside the wheel)"


def target_text(prompt: str) -> str:
    """The text between the first pair of double quotes, spaces removed and lower-cased. ValueError when there is
    none (or it is empty once spaces are removed)."""
    m = _QUOTED.search(prompt)
    if m is None:
        raise ValueError(f"the prompt has no target text between double quotes: {prompt[:80]!r}")
    target = normalize(m.group(1))
    if not target:
        raise ValueError(f"the prompt's quoted target is empty (after removing spaces): {prompt[:80]!r}")
    return target


def normalize(text: str) -> str:
    """flow_grpo's normalization: spaces removed, lower-cased."""
    return text.replace(" ", "").lower()


def levenshtein(a: str, b: str) -> int:
    """Edit distance (insertions, deletions, substitutions of one character each)."""
    if len(a) < len(b):
        a, b = b, a
    prev = list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        cur = [i]
        for j, cb in enumerate(b, 1):
            cur.append(min(prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (ca != cb)))
        prev = cur
    return prev[-1]


def ocr_distance(recognized: Optional[str], target: str) -> int:
    """flow_grpo's distance of the OCR'd text to the (normalized) target; None (the OCR failed) is len(target)."""
    if recognized is None:
        return len(target)
    rec = normalize(recognized)
    dist = 0 if target in rec else levenshtein(rec, target)
    return min(dist, len(target))


def ocr_reward(recognized: Optional[str], target: str) -> float:
    """1 - distance / len(target) (`target` as `target_text` gives it: normalized, non-empty)."""
    return 1.0 - ocr_distance(recognized, target) / len(target)


def load_rapidocr(**engine_kwargs):
    """A `rapidocr_onnxruntime.RapidOCR` engine (its models come from the wheel; nothing is downloaded)."""
    try:
        from rapidocr_onnxruntime import RapidOCR
    except ImportError as e:
        raise ImportError(f"reward fn 'ocr' needs rapidocr-onnxruntime: {INSTALL_HINT} ({e})") from e
    return RapidOCR(**engine_kwargs)


class OcrScorer:
    """flow_grpo's OCR reward (see the module docstring). The engine is built once per scorer (so once per reward
    worker) and reads one image at a time (RapidOCR has no batch call); a video scores its frames' mean.

    `engine`: any callable `engine(hwc_uint8_rgb, use_cls=...) -> (lines, elapsed)` with lines `[[box, text,
    confidence], ...]` or None (RapidOCR's interface), for tests or another engine; default: RapidOCR. The image goes in
    as RGB HWC uint8, the array flow_grpo hands PaddleOCR.
    """

    def __init__(self, engine: Any = None, use_cls: bool = False):
        # use_cls=False: flow_grpo calls PaddleOCR with cls=False (no text-direction classifier)
        self.engine = engine if engine is not None else load_rapidocr()
        self.use_cls = bool(use_cls)
        self.failures = 0
        self._lock = threading.Lock()  # the manager runs sync scorers in threads; one OCR session at a time

    @classmethod
    def check_kwargs(cls, kwargs: dict) -> list[str]:
        """Before anything starts: the default engine's package is installed (nothing is imported here)."""
        import importlib.util

        if kwargs.get("engine") is None and importlib.util.find_spec("rapidocr_onnxruntime") is None:
            return [f"fn: 'ocr' needs rapidocr-onnxruntime, which is not installed: {INSTALL_HINT}"]
        return []

    def recognize(self, image_hwc: np.ndarray) -> Optional[str]:
        """The joined text of lines with confidence > 0 ("" when nothing is found); None when the engine raised."""
        try:
            with self._lock:
                lines, _ = self.engine(image_hwc, use_cls=self.use_cls)
        except Exception:  # noqa: BLE001 - an OCR failure scores distance = len(target) and is counted (flow_grpo)
            return None
        return "".join(str(line[1]) for line in (lines or []) if float(line[2]) > 0)

    def score_one(self, sample) -> dict:
        """`sample`: an `omniroll.reward.RewardSample` (read by attribute: `scorers.py`, its home, imports this module
        for its registry, so this one does not import it back)."""
        target = target_text(sample.prompt)
        frames = sample.frames().transpose(0, 2, 3, 1)
        texts = [self.recognize(np.ascontiguousarray(f)) for f in frames]
        failed = sum(t is None for t in texts)
        self.failures += failed
        reward = float(np.mean([ocr_reward(t, target) for t in texts]))
        return {"score": reward, "ocr_failed": failed, "text": texts[0] if texts[0] is not None else ""}

    def __call__(self, samples: list) -> list:
        out: list = []
        for s in samples:
            try:
                out.append(self.score_one(s))
            except ValueError as e:  # this row's prompt has no target: its own error, the others are scored
                out.append(ValueError(f"sample {s.sample_id!r}: {e}"))
        return out
