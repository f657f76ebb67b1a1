"""The docs build's hook: it stops the build when a generated page or region is stale (`docs/hooks/generated.py`
writes them; they are committed so that they read on GitHub)."""

from __future__ import annotations

from mkdocs.exceptions import PluginError

import generated  # docs/hooks/generated.py (mkdocs puts a hook's directory on sys.path while it loads it)


def on_pre_build(config):
    stale = generated.stale()
    if stale:
        raise PluginError("generated docs are stale: " + "; ".join(stale)
                          + ". Run `make docs-generate` (python docs/hooks/generated.py) and commit the result.")
