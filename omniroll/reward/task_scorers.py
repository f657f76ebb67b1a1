"""The registry factory a task world's rewards share (`task_scorer`): a scorer that takes no kwargs, and the world's
own prompt check (`check_prompts`), so that a prompt outside its grammar is refused before anything starts."""

from __future__ import annotations

from typing import Callable


def task_scorer(fn: Callable, check_prompts: Callable[[list], list[str]], what: str) -> Callable:
    """A factory for `SCORER_REGISTRY` that returns `fn` itself; `what` names the rewards in the kwargs error (e.g.
    "the shapes rewards")."""

    def factory(**kwargs):
        if kwargs:
            raise ValueError(f"reward scorer {fn.__name__!r} takes no kwargs, got {sorted(kwargs)}")
        return fn

    factory.check_kwargs = lambda kwargs: [f"kwargs: {what} take no kwargs, got {sorted(kwargs)}"] if kwargs else []
    factory.check_prompts = check_prompts
    return factory
