"""Agent-loop registry: `@register("name")` on a loop class; `get_agent_loop_class(name)` to look one up."""

from __future__ import annotations

import importlib
from typing import Callable

_REGISTRY: dict[str, type] = {}


def register(name: str) -> Callable[[type], type]:
    """Class decorator: make an agent-loop class available as `agent_name=name`."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"agent loop name must be a non-empty string, got {name!r}")

    def deco(cls: type) -> type:
        prev = _REGISTRY.get(name)
        if prev is not None and prev is not cls and prev.__qualname__ != cls.__qualname__:
            raise ValueError(f"agent loop {name!r} is already registered to {prev.__module__}.{prev.__qualname__}")
        _REGISTRY[name] = cls
        return cls

    return deco


#: the built-in loops: name -> the module that registers it (imported on first lookup, as `cli.COMMANDS` does), so
#: this registry imports no loop and no loop's import of `register` makes a cycle.
BUILTINS = {"diffusion_single_turn_agent": "omniroll.agent_loop.single_turn"}


def get_agent_loop_class(name: str) -> type:
    if name not in _REGISTRY and name in BUILTINS:
        importlib.import_module(BUILTINS[name])
    try:
        return _REGISTRY[name]
    except KeyError:
        raise KeyError(f"unknown agent_name {name!r}; registered agent loops: {registered_names()}") from None


def registered_names() -> list[str]:
    for module in BUILTINS.values():
        importlib.import_module(module)
    return sorted(_REGISTRY)
