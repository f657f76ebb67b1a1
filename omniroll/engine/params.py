"""What a caller asks for: `SamplingParams` (validated, per request) and `GenerationRequest`.

Each sampling field's type and bounds are declared once, here (`Pixels`, `Steps`, `SdeType`, ...): the YAML
sections (`omniroll.config`), the requests and the CLI flags all use these declarations. `overlay_sampling` is the one
rule for laying an override over a sampling dict (validation turns log-probs off).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from omniroll.sampling.window import sde_window_bounds

Pixels = Annotated[int, Field(ge=16, le=4096)]
NumFrames = Annotated[int, Field(ge=1, le=1025)]
Fps = Annotated[int, Field(ge=1, le=240)]
Steps = Annotated[int, Field(ge=1, le=1000)]
GuidanceScale = Annotated[float, Field(ge=0.0, le=100.0)]
TrueCfgScale = Annotated[float, Field(ge=1.0, le=100.0)]
SequenceLength = Annotated[int, Field(ge=1, le=512)]
NoiseLevel = Annotated[float, Field(ge=0.0, le=10.0)]
SdeType = Literal["sde", "cps", "dance_sde", "ode"]  # = omniroll.sampling.sde.SDE_TYPES (tested; sde.py needs torch)
SolverName = Literal["euler", "dpmpp_2m"]  # = omniroll.sampling.solvers.SOLVER_NAMES (tested; solvers.py needs torch)
WindowSize = Annotated[int, Field(ge=1, le=1000)]
WindowRange = tuple[int, int]
OutputType = Literal["pixel", "latent", "both"]
#: the dtypes a model computes in (engine, trainer, reward models): `engine.config.torch_dtype` turns one into torch's
DtypeName = Literal["float32", "bfloat16", "float16"]
DTYPE_NAMES: tuple[str, ...] = ("float32", "bfloat16", "float16")


class SamplingParams(BaseModel):
    """Per-request sampling parameters. Every field is validated; errors name the field and its allowed range.

    SDE window: steps in `[start, start + sde_window_size)` inject noise and (with `logprobs`) record latents and
    log-probs; the others are deterministic steps of `solver` (Euler by default; sampling/solvers.py) and record
    nothing. Without `logprobs` nothing is recorded: a
    forward-process trainer (NFT, AWM) asks for the final latent only (`output_type` "both" or "latent").
    `sde_window_size=None` means every step but the last (Flow-GRPO's default: the last step's Gaussian is too sharp).
    With a size, `start` is drawn uniformly from `[lo, hi - size]` using the request's own generator, where `(lo, hi) =
    sde_window_range or (0, T - 1)`.

    `latent_seed` (flow_grpo's `same_latent`): when set, the initial noise and the SDE window are drawn from this
    seed instead of the request's; the noise inside the window still comes from the request's own seed. Give every
    sample of a group the same `latent_seed`: their steps before the window are then one deterministic ODE
    trajectory, which the engine computes once per group and forks at the window's start (every output stays
    bitwise identical to running the sample alone).

    `noise_seeds` (a tree rollout's branches): `[[step, seed], ...]`, steps strictly increasing in
    `[1, num_inference_steps)`: from each `step` on, the window's noise is drawn from a fresh generator of `seed`
    instead of continuing the one before (the request's own seed draws the noise before the first such step). Samples
    that agree on `latent_seed`, `seed` and the pairs before a step compute the same steps up to it, which the engine
    runs once (`omniroll.engine.prefix_tree`); each one alone gives the same sample, bitwise.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    height: Pixels = Field(256, description="pixels, a multiple of the model's spatial factor")
    width: Pixels = Field(256, description="pixels, a multiple of the model's spatial factor")
    num_frames: NumFrames = Field(1, description="1 for images; video models check their own rule (Wan: 4k + 1)")
    fps: Fps = Field(16, description="frames per second of a video output (metadata only)")
    num_inference_steps: Steps = 10
    guidance_scale: GuidanceScale = Field(4.5, description="CFG scale (<= 1 disables CFG); for guidance-distilled "
                                                           "models (FLUX.1) the guidance the model is given")
    true_cfg_scale: TrueCfgScale = Field(1.0, description="guidance-distilled models only: real CFG on top (> 1 adds "
                                                          "an unconditional row)")
    max_sequence_length: SequenceLength = Field(128, description="T5 tokens")
    noise_level: NoiseLevel = Field(0.7, description="eta; 0 gives the ODE")
    sde_type: SdeType = "sde"
    solver: SolverName = Field("euler", description="the deterministic steps' solver (outside the SDE window, and "
                                                    "every step at noise level 0): euler or dpmpp_2m")
    sde_window_size: Optional[WindowSize] = None
    sde_window_range: Optional[WindowRange] = None
    logprobs: bool = Field(True, description="record the window steps' latents and log-probs (False: nothing is "
                                             "recorded, as for validation and forward-process algorithms)")
    output_type: OutputType = "pixel"
    latent_seed: Optional[int] = Field(None, ge=0, lt=2**63, description="shared initial noise + window (a group)")
    noise_seeds: Optional[tuple[tuple[int, int], ...]] = Field(
        None, description="[[step, seed], ...]: from each step on, the window's noise comes from a fresh generator of "
                          "seed (a tree rollout's branches; steps strictly increasing in [1, num_inference_steps))")

    @field_validator("*", mode="before")
    @classmethod
    def _no_bool_as_number(cls, v, info):
        return refuse_bool_as_number(cls, v, info)

    @model_validator(mode="after")
    def _check_window(self):
        sde_window_bounds(self.num_inference_steps, self.sde_window_size, self.sde_window_range)
        check_noise_seeds(self.noise_seeds, self.num_inference_steps)
        return self

    def window_range(self) -> tuple[int, int]:
        return sde_window_bounds(self.num_inference_steps, self.sde_window_size, self.sde_window_range)

    @property
    def stochastic(self) -> bool:
        return self.sde_type != "ode" and self.noise_level > 0.0

    def batch_key(self) -> tuple:
        """Rows that share this key can share a forward (same latent shape and text length)."""
        return (self.num_frames, self.height, self.width, self.max_sequence_length)


def overlay_sampling(base: dict, override: Any, validate: bool, name: str = "sampling_params") -> dict:
    """`base` with `override` (a dict of SamplingParams fields, or None) laid over it; validation samples never
    compute log-probs. ValueError naming `name` when `override` is not a dict."""
    if override is not None and not isinstance(override, dict):
        raise ValueError(f"{name} must be a dict, got {type(override).__name__}")
    sp = {**base, **(override or {})}
    if validate:
        sp["logprobs"] = False
    return sp


class GenerationRequest(BaseModel):
    """One sample to generate. `seed` fixes the initial latent, the window draw and every noise draw.

    The prompt is text (`prompt`) or, as a trainer that tokenizes on its side sends it, per-encoder token ids
    (`prompt_token_ids`, e.g. SD3: `{"clip": [...], "t5": [...]}`, unpadded, with the tokenizers' special tokens; the
    model adapter's `tokenize` gives exactly what the text path encodes). Exactly one of the two. The negative prompt
    likewise (`negative_prompt` or `negative_prompt_token_ids`; neither means the empty prompt).
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    request_id: str = Field(min_length=1)
    prompt: Optional[str] = None
    negative_prompt: Optional[str] = None
    prompt_token_ids: Optional[dict[str, list[int]]] = None
    negative_prompt_token_ids: Optional[dict[str, list[int]]] = None
    sampling_params: SamplingParams = Field(default_factory=SamplingParams)
    seed: int = Field(ge=0, lt=2**63)

    @model_validator(mode="after")
    def _check_prompt(self):
        if (self.prompt is None) == (self.prompt_token_ids is None):
            raise ValueError("give exactly one of prompt (text) and prompt_token_ids (per-encoder token ids)")
        if self.negative_prompt is not None and self.negative_prompt_token_ids is not None:
            raise ValueError("give at most one of negative_prompt and negative_prompt_token_ids")
        return self

    def prompt_input(self) -> "str | dict[str, list[int]]":
        """What the engine encodes: the text or the token ids."""
        return self.prompt if self.prompt_token_ids is None else self.prompt_token_ids

    def negative_input(self) -> "str | dict[str, list[int]]":
        if self.negative_prompt_token_ids is not None:
            return self.negative_prompt_token_ids
        return self.negative_prompt or ""

    @field_validator("seed", mode="before")
    @classmethod
    def _no_bool_as_number(cls, v, info):
        return refuse_bool_as_number(cls, v, info)

    @field_validator("prompt", "negative_prompt", mode="before")
    @classmethod
    def _text_not_bytes(cls, v):
        if isinstance(v, (bytes, bytearray)):
            raise ValueError(f"must be text (str), got {type(v).__name__}: decode it first")
        return v

    @field_validator("prompt", "negative_prompt")
    @classmethod
    def _check_encodable(cls, v):
        if isinstance(v, str):
            reason = unencodable_reason(v)
            if reason is not None:
                raise ValueError(reason)
        return v


def check_noise_seeds(noise_seeds, num_steps: int) -> None:
    """`SamplingParams.noise_seeds`: ValueError naming the field unless steps are strictly increasing in [1, num_steps)
    and seeds in [0, 2**63)."""
    if noise_seeds is None:
        return
    prev = 0
    for i, (step, seed) in enumerate(noise_seeds):
        if isinstance(step, bool) or isinstance(seed, bool):
            raise ValueError(f"noise_seeds[{i}] must be [step, seed] ints, got {[step, seed]!r}")
        if not (prev < step < num_steps):
            raise ValueError(f"noise_seeds[{i}] step must be in [{prev + 1}, {num_steps - 1}] (strictly increasing, "
                             f"inside num_inference_steps={num_steps}), got {step}")
        if not (0 <= seed < 2**63):
            raise ValueError(f"noise_seeds[{i}] seed must be in [0, 2**63), got {seed}")
        prev = step


def refuse_bool_as_number(model: type[BaseModel], value, info):
    """`True` / `False` given for a numeric field is refused, not read as 1 / 0 (pydantic's lax mode would)."""
    annotation = str(model.model_fields[info.field_name].annotation)
    if isinstance(value, bool) and "bool" not in annotation:
        raise ValueError(f"must be a number, got the bool {value!r}")
    return value


def unencodable_reason(text: str) -> Optional[str]:
    """Why `text` is not encodable text (None when it is). A lone surrogate (what a JSON `\\ud800` escape gives)
    cannot be UTF-8 encoded and no tokenizer takes it. The message names the position, never echoes the text."""
    try:
        text.encode("utf-8", errors="strict")
    except UnicodeEncodeError as e:
        return (f"is not encodable text: character U+{ord(text[e.start]):04X} at position {e.start} "
                f"({e.reason}); send valid UTF-8")
    return None
