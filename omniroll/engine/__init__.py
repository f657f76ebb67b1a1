"""The engine layer: request state, scheduler, runner, the denoise loop, lifecycle (weights, sleep / wake).

Import-light on purpose (`import omniroll` must not pull in diffusers or PEFT): use
`from omniroll.engine.engine import DiffusionEngine` or `from omniroll import DiffusionEngine`.
One concept per module: `config` (EngineConfig), `params` (SamplingParams, GenerationRequest, each sampling field's
declaration), `output` (DiffusionOutput), `request` (RequestState, and how a finished one becomes a DiffusionOutput),
`admission` (a request from arrival to its first step: every check, the prompt-encoding cache), `scheduler` (the
rows of each step, and group prefix sharing), `calibrate` (max_batch_size "auto"), `runner` (one batched step:
`DiffusionAdapter.guided_velocity` then `sde_step`; the decode; batch-invariant execution, `execution_mode`),
`decode_queue` (finished samples waiting for a decode block), `lifecycle` (the weights and memory state the engine
owns: version, sleep level, LoRA, transactional updates), `step_pause` (no step after k more), `inbox` (what carries
requests and control calls to the loop thread), `control` (weight, LoRA, sleep and wake calls between steps),
`errors`, `engine` (the loop, submission, aborts, shutdown).
"""
