"""Third-party warnings an omniroll user cannot act on, and `silence_library_warnings`, which filters exactly those.

Every `omniroll` process calls it where it starts (the CLI's `main`, each replica and reward-worker actor) and before
a model loads (`models.base.load_pipeline`), so the driver and the Ray actors say the same. Each entry names the
library's logger or warning module and a message pattern: nothing else is filtered, and nothing omniroll itself says.
A message a user can act on stays (Ray's note on token authentication, for one, names the setting that changes it).

What is filtered, and why a user cannot act on it:
- transformers' "`CLIPImageProcessor` requires torchvision (not installed); falling back to `CLIPImageProcessorPil`"
  (and the same for every `*ImageProcessor`), logged once per process when diffusers imports its pipelines (the SD3
  pipeline names `SiglipImageProcessor`, diffusers' IP-adapter loader `CLIPImageProcessor`, both for optional image
  encoders omniroll never loads) or a CLIP scorer loads its processor. The PIL backend it falls back to is the one
  transformers used before 5.x and the one omniroll's scorers are tested with; torchvision is not an omniroll
  dependency, and the other fix the message offers (import the Pil class) is in diffusers' code, not the user's.
- diffusers' "Expected types for text_encoder: (<class '...UMT5EncoderModel'>,), got <class '...BertModel'>", logged
  each time a `WanPipeline` is built with a BERT text encoder, as the shapes-video model is (`omniroll.models.
  shapes_video.text` says why: a BERT's absolute positions let the transformer read word order). The check compares
  with the pipeline class's annotation; the pipeline runs a BERT unchanged (tested), and only that pair is filtered.

With the installed versions (transformers 5.24, diffusers 0.42, torch 2.13, Ray 2.60) that is all a run of
`examples/train.yaml` printed besides omniroll's own lines and Ray's token note, in the driver and in the actors'
logs, also with `PYTHONWARNINGS=default` (no FutureWarning or DeprecationWarning came up). Imports only the
standard library (the CLI calls it before torch is imported).
"""

from __future__ import annotations

import logging
import re

#: (logger name, message pattern): log records of a third-party library about its own internals
LOG_RECORDS: tuple[tuple[str, str], ...] = (
    ("transformers.utils.import_utils", r"`\w+ImageProcessor` requires torchvision \(not installed\); falling back"),
    ("diffusers.pipelines.pipeline_utils",
     r"^Expected types for text_encoder: \(<class '[\w.]+\.UMT5EncoderModel'>,\), got <class '[\w.]+\.BertModel'>\.$"),
)


class _DropMatching(logging.Filter):
    """Drops the records of one logger whose message matches a pattern (all other records pass)."""

    def __init__(self, pattern: str):
        super().__init__()
        self.pattern = re.compile(pattern)

    def filter(self, record: logging.LogRecord) -> bool:
        return not self.pattern.search(record.getMessage())


def silence_library_warnings() -> None:
    """Install the filters above in this process (idempotent: a second call adds nothing)."""
    for name, pattern in LOG_RECORDS:
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropMatching) and f.pattern.pattern == pattern for f in logger.filters):
            logger.addFilter(_DropMatching(pattern))
