"""`pickscore`, `clip_score`, `aesthetic`: CLIP-based rewards, loaded with transformers' CLIP classes from local
directories named in the reward config (nothing is downloaded).

| fn | kwargs | score |
|---|---|---|
| `pickscore` | `model_dir` (PickScore_v1), `processor_dir` (CLIP-ViT-H-14's processor) | `logit_scale * cos(image, text) / 26` |
| `clip_score` | `model_dir` (e.g. clip-vit-large-patch14), `processor_dir` (default: `model_dir`) | `logit_scale * cos(image, text) / 30` |
| `aesthetic` | `model_dir` (clip-vit-large-patch14), `processor_dir`, `head_path` (LAION's MLP head) | `head(image_embed / |image_embed|)` |

These are flow_grpo's formulas (`pickscore_scorer.py`, `clip_scorer.py`, `aesthetic_scorer.py`; VeRL-Omni's PickScore
is the same): `logit_scale` is the model's own (`exp` of its learned log scale, 100 for OpenAI's CLIP), cos the
cosine of the projected image and text embeddings. The aesthetic head is LAION's improved-aesthetic-predictor MLP
(`sac+logos+ava1-l14-linearMSE.pth`: Linear(768, 1024), Linear(1024, 128), Linear(128, 64), Linear(64, 16),
Linear(16, 1) with dropout between, no activations) on the L2-normalized CLIP image embedding.

Every scorer takes `device` (default "cpu"), `dtype` (float32 / bfloat16 / float16) and `batch_size` (images per
forward). The model is loaded once when the scorer is built, i.e. once per reward worker. A video scores the mean
over its frames. A missing or wrong directory or file is one ValueError naming the kwarg and the path
(`check_kwargs` runs the same checks without loading anything, so a config is refused before anything starts).
"""

from __future__ import annotations

import json
import os
from typing import Optional

import numpy as np

from omniroll.engine.params import DTYPE_NAMES

DTYPES = DTYPE_NAMES  # a scorer's `dtype`
#: the LAION aesthetic head's Linear layers as `nn.Sequential` indices (dropouts at 1, 3, 5)
HEAD_LINEARS = (0, 2, 4, 6, 7)


def _dir_problems(key: str, path, need: tuple[str, ...], model_type: Optional[str] = None) -> list[str]:
    """Why `path` (the value of kwargs[key]) is not a usable save_pretrained directory (empty list: it is). Each entry
    of `need` is a file name, or alternatives separated by "|"."""
    if not isinstance(path, (str, os.PathLike)) or not os.fspath(path):
        return [f"kwargs.{key}: expected a local directory path, got {path!r}"]
    path = os.fspath(path)
    if not os.path.isdir(path):
        return [f"kwargs.{key}: directory not found: {path!r}"]
    missing = [f.replace("|", " or ") for f in need
               if not any(os.path.isfile(os.path.join(path, alt)) for alt in f.split("|"))]
    if missing:
        return [f"kwargs.{key}: {path!r} is not a transformers save_pretrained directory of the right kind "
                f"(no {', '.join(missing)})"]
    if model_type is not None:
        try:
            with open(os.path.join(path, "config.json")) as f:
                found = json.load(f).get("model_type")
        except (OSError, ValueError, AttributeError) as e:
            return [f"kwargs.{key}: cannot read {os.path.join(path, 'config.json')!r}: {e}"]
        if found != model_type:
            return [f"kwargs.{key}: {path!r} holds a {found!r} model, expected a CLIP model (model_type "
                    f"{model_type!r})"]
    return []


def _common_problems(kwargs: dict, text: bool) -> list[str]:
    out = _dir_problems("model_dir", kwargs.get("model_dir"), ("config.json",), "clip")
    image = "preprocessor_config.json|processor_config.json"  # the second: transformers >= 5's save_pretrained
    need = (image, "tokenizer_config.json") if text else (image,)
    out += _dir_problems("processor_dir", kwargs.get("processor_dir") or kwargs.get("model_dir"), need)
    if kwargs.get("dtype", "float32") not in DTYPES:
        out.append(f"kwargs.dtype: must be one of {DTYPES}, got {kwargs.get('dtype')!r}")
    bs = kwargs.get("batch_size", 16)
    if not isinstance(bs, int) or isinstance(bs, bool) or not 1 <= bs <= 4096:
        out.append(f"kwargs.batch_size: must be an int in [1, 4096], got {bs!r}")
    if not isinstance(kwargs.get("device", "cpu"), str):
        out.append(f"kwargs.device: must be a torch device string such as 'cpu' or 'cuda:0', got "
                   f"{kwargs.get('device')!r}")
    return out


class _ClipBase:
    """Loads a `CLIPModel` and its processor once; subclasses turn embeddings into scores."""

    text = True  # needs the tokenizer (scores image against prompt)

    def __init__(self, model_dir: str, processor_dir: Optional[str] = None, device: str = "cpu",
                 dtype: str = "float32", batch_size: int = 16):
        kwargs = {"model_dir": model_dir, "processor_dir": processor_dir, "device": device, "dtype": dtype,
                  "batch_size": batch_size}
        problems = _common_problems(kwargs, self.text)
        if problems:
            raise ValueError("; ".join(problems))
        import torch
        from transformers import CLIPImageProcessor, CLIPModel, CLIPProcessor

        from omniroll.engine.config import torch_dtype

        self.device = torch.device(device)
        self.batch_size = batch_size
        self.model = CLIPModel.from_pretrained(model_dir, torch_dtype=torch_dtype(dtype)).to(self.device).eval()
        self.model.requires_grad_(False)
        processor_dir = processor_dir or model_dir
        if self.text:
            self.processor = CLIPProcessor.from_pretrained(processor_dir)
            self.image_processor = self.processor.image_processor
        else:
            self.processor = None
            self.image_processor = CLIPImageProcessor.from_pretrained(processor_dir)

    @classmethod
    def check_kwargs(cls, kwargs: dict) -> list[str]:
        """The problems of these kwargs (paths, dtype, batch size) without loading anything."""
        return _common_problems(kwargs, cls.text)

    def image_embeds(self, images_hwc: list[np.ndarray]):
        """L2-normalized fp32 image embeddings [N, D]."""
        import torch

        pixels = self.image_processor(images=list(images_hwc), return_tensors="pt")["pixel_values"]
        with torch.no_grad():
            emb = self.model.get_image_features(pixel_values=pixels.to(self.device, self.model.dtype))
        emb = _features(emb).float()
        return emb / emb.norm(dim=-1, keepdim=True)

    def text_embeds(self, prompts: list[str]):
        """L2-normalized fp32 text embeddings [N, D] (truncated to the tokenizer's length, CLIP's 77)."""
        import torch

        tok = self.processor.tokenizer
        inputs = tok(list(prompts), padding=True, truncation=True, max_length=tok.model_max_length,
                     return_tensors="pt")
        with torch.no_grad():
            emb = self.model.get_text_features(**{k: v.to(self.device) for k, v in inputs.items()})
        emb = _features(emb).float()
        return emb / emb.norm(dim=-1, keepdim=True)

    def score_frames(self, frames_hwc: list[np.ndarray], prompts: list[str]) -> np.ndarray:
        raise NotImplementedError

    def __call__(self, samples: list) -> list[float]:
        """`samples`: `omniroll.reward.RewardSample`s (read by attribute: `scorers.py`, their home, imports this
        module for its registry, so this one does not import it back)."""
        frames, prompts, owner = [], [], []
        for i, s in enumerate(samples):
            for f in s.frames():
                frames.append(np.ascontiguousarray(f.transpose(1, 2, 0)))
                prompts.append(s.prompt)
                owner.append(i)
        scores = np.concatenate([self.score_frames(frames[k:k + self.batch_size], prompts[k:k + self.batch_size])
                                 for k in range(0, len(frames), self.batch_size)]) if frames else np.zeros(0)
        owner_arr = np.asarray(owner)
        return [float(scores[owner_arr == i].mean()) for i in range(len(samples))]


def _features(out):
    """`get_*_features` returns a tensor (transformers < 5) or an output object holding `pooler_output`."""
    return out if hasattr(out, "norm") else out.pooler_output


class _ScaledCosine(_ClipBase):
    divisor = 1.0

    def score_frames(self, frames_hwc, prompts):
        cos = (self.image_embeds(frames_hwc) * self.text_embeds(prompts)).sum(-1)
        return (self.model.logit_scale.exp().float() * cos / self.divisor).cpu().numpy()


class PickScoreScorer(_ScaledCosine):
    """PickScore (Kirstain et al. 2023) as flow_grpo and VeRL-Omni compute it: `logit_scale * cos / 26`.
    `model_dir`: a PickScore_v1 save_pretrained directory; `processor_dir`: CLIP-ViT-H-14-laion2B's processor."""

    divisor = 26.0


class ClipScoreScorer(_ScaledCosine):
    """flow_grpo's CLIP score: `logits_per_image.diagonal() / 30`, i.e. `logit_scale * cos / 30`."""

    divisor = 30.0


class AestheticScorer(_ClipBase):
    """flow_grpo's aesthetic score: LAION's MLP head on the L2-normalized CLIP (ViT-L/14) image embedding.
    `head_path`: the head's state dict (`.pth`, read with `torch.load(weights_only=True)`: no code runs; or
    `.safetensors`), keys `layers.{0,2,4,6,7}.{weight,bias}`."""

    text = False

    def __init__(self, model_dir: str, head_path: str, processor_dir: Optional[str] = None, device: str = "cpu",
                 dtype: str = "float32", batch_size: int = 16):
        problems = _head_problems(head_path)
        if problems:
            raise ValueError("; ".join(problems))
        super().__init__(model_dir, processor_dir, device, dtype, batch_size)
        self.head = load_aesthetic_head(head_path, self.model.config.projection_dim).to(self.device).eval()

    @classmethod
    def check_kwargs(cls, kwargs: dict) -> list[str]:
        return _common_problems(kwargs, text=False) + _head_problems(kwargs.get("head_path"))

    def score_frames(self, frames_hwc, prompts):
        import torch

        with torch.no_grad():
            return self.head(self.image_embeds(frames_hwc)).squeeze(-1).cpu().numpy()


def _head_problems(path) -> list[str]:
    if not isinstance(path, (str, os.PathLike)) or not os.fspath(path):
        return [f"kwargs.head_path: expected the path of the aesthetic head's weights file, got {path!r}"]
    if not os.path.isfile(path):
        return [f"kwargs.head_path: file not found: {os.fspath(path)!r}"]
    return []


def aesthetic_head(in_features: int = 768):
    """LAION's improved-aesthetic-predictor MLP (its layer indices, so its state dict loads as is)."""
    from torch import nn

    return nn.Sequential(nn.Linear(in_features, 1024), nn.Dropout(0.2), nn.Linear(1024, 128), nn.Dropout(0.2),
                         nn.Linear(128, 64), nn.Dropout(0.1), nn.Linear(64, 16), nn.Linear(16, 1))


def load_aesthetic_head(path: str, in_features: int):
    """The head from `path` (keys with or without the `layers.` prefix). ValueError naming `head_path` when the file
    is unreadable, not a state dict of this head, or made for another embedding width than the CLIP's."""
    import torch

    try:
        if str(path).endswith(".safetensors"):
            from safetensors.torch import load_file

            state = load_file(path)
        else:
            state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - any unreadable file is the user's path problem
        raise ValueError(f"kwargs.head_path: cannot read {os.fspath(path)!r} as a state dict: "
                         f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}") from None
    if not isinstance(state, dict):
        raise ValueError(f"kwargs.head_path: {os.fspath(path)!r} holds a {type(state).__name__}, not a state dict")
    state = {k.removeprefix("layers."): v for k, v in state.items()}
    first = state.get("0.weight")
    if first is None or getattr(first, "ndim", 0) != 2:
        raise ValueError(f"kwargs.head_path: {os.fspath(path)!r} is not the LAION aesthetic head (no layers.0.weight "
                         f"matrix; keys {sorted(state)[:6]})")
    if first.shape[1] != in_features:
        raise ValueError(f"kwargs.head_path: {os.fspath(path)!r} takes {first.shape[1]}-wide embeddings, but the "
                         f"CLIP in model_dir projects to {in_features}")
    head = aesthetic_head(in_features)
    try:
        head.load_state_dict(state)
    except RuntimeError as e:
        raise ValueError(f"kwargs.head_path: {os.fspath(path)!r} does not fit the LAION aesthetic head: "
                         f"{str(e).splitlines()[0]}") from None
    return head.float()
