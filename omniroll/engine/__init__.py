"""The engine layer: request state, scheduler, runner, the denoise loop, lifecycle (weights, sleep / wake).

Import-light on purpose (`import omniroll` must not pull in diffusers or PEFT): use
`from omniroll.engine.engine import DiffusionEngine` or `from omniroll import DiffusionEngine`.
One concept per module: `params` (SamplingParams, GenerationRequest), `output` (DiffusionOutput), `request`
(RequestState), `scheduler`, `runner` (one batched forward incl. CFG), `invariant` (batch-invariant execution),
`prompt_cache`, `packaging` (RequestState -> DiffusionOutput), `lifecycle` (the weights and memory state the engine
owns: version, sleep level, LoRA, transactional updates), `errors`, `engine` (the loop, control calls, shutdown).
"""
