"""The engine layer: request state, scheduler, runner, the denoise loop, lifecycle (weights, sleep / wake).

Import-light on purpose (`import omniroll` must not pull in diffusers or PEFT): use
`from omniroll.engine.engine import DiffusionEngine` or `from omniroll import DiffusionEngine`.
One concept per module: `config` (EngineConfig), `params` (SamplingParams, GenerationRequest, each sampling field's
declaration), `output` (DiffusionOutput), `request` (RequestState), `admission` (every check of a request, prompt
encodings), `inbox` (requests and control calls on their way to the loop thread), `scheduler`, `prefix` (shared ODE
prefixes), `calibrate` (max_batch_size "auto"), `runner` (one batched step: `DiffusionAdapter.guided_velocity` then
`sde_step`), `invariant` (batch-invariant execution, `execution_mode`), `prompt_cache`, `decode_queue` (finished
samples waiting for a decode block), `packaging` (RequestState -> DiffusionOutput), `lifecycle` (the weights and
memory state the engine owns: version, sleep level, LoRA, transactional updates), `control` (weight, LoRA, sleep
and wake calls between steps), `errors`, `engine` (the loop, submission, aborts, shutdown).
"""
