"""The agent loops a config may name: the registry (`@register("name")` on a loop class, `get_agent_loop_class(name)`
to look one up for a row's `agent_name` or `agent.default_agent_loop`, `registered_names()`).

It sits in `config/` so that `agent.default_agent_loop` is checked when the config is loaded, before anything starts
(`config` may not import the agent loop, which sits above it): the built-in loop's name is declared here
(`SINGLE_TURN`, registered by `omniroll.agent_loop.loop`), and a loop of your own is known once the module whose
`@register(...)` defines it has been imported.
"""

from __future__ import annotations

from typing import Callable

#: the built-in single-turn loop (omniroll.agent_loop.loop.DiffusionSingleTurnAgentLoop), the config's default
SINGLE_TURN = "diffusion_single_turn_agent"

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
    """Every name a config or a row may use: the built-in loop's and those registered so far."""
    return sorted(set(_REGISTRY) | {SINGLE_TURN})


def check_agent_loop(name: str) -> str:
    """`name` if it is registered; else ValueError listing the registered names (what `agent.default_agent_loop`
    is checked with at load time)."""
    if name not in registered_names():
        raise ValueError(f"agent loop {name!r} is not registered, the registered ones are {registered_names()} "
                         f"(import the module whose @register(...) defines it before loading the config)")
    return name
