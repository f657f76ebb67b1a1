"""The registry of agent loops: `@register("name")` on a loop class, `get_agent_loop_class(name)` to look one up (a
row's `agent_name`, else `agent.default_agent_loop`), `registered_names()`."""

from __future__ import annotations

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


def get_agent_loop_class(name: str) -> type:
    try:
        return _REGISTRY[name]
    except KeyError:
        raise KeyError(f"unknown agent_name {name!r}; registered agent loops: {registered_names()}") from None


def registered_names() -> list[str]:
    return sorted(_REGISTRY)
