"""`ModuleTree`: a module tree read once and kept between weight updates, with a cheap check that it is still the
tree that was read.

A full update reads the sender's module (what travels) and the receiver's (where each tensor lands). Walking a
transformer of a few hundred modules for that costs about half a millisecond per side and per update, a tenth of
the copy itself, so both sides keep the walk of their module and only check it before reuse. The check is complete
for what a walk reads: `current()` is False as soon as any module of the tree gained, lost or replaced a parameter,
a buffer or a child module (or its `_parameters` / `_buffers` / `_modules` dict itself was replaced), changed which
buffers persist, changed class, or got or lost its state-dict hooks. It compares every dict's length and every kept
entry's identity: equal lengths and identical kept entries mean identical dicts. Identity is safe because the tree
holds each object it read, so no id can be reused. Values, shapes and dtypes are not part of the tree: the tree
holds the tensor objects, and their current shape and dtype are read at every update (`param.data = ...` keeps the
object).

`state_items()` reads `state_dict()`'s items from the tree (the sender's read); `unique_modules()` is what the
receiver reads its targets from. Both walks are pre-order with children in registration order (`state_dict()`'s
order); `modules` keeps a module shared under two names under both (as `state_dict()` does), `unique_modules()` once
(as `named_modules()` does).
"""

from __future__ import annotations

import torch
from torch import nn


class ModuleTree:
    def __init__(self, module: nn.Module):
        self.module = module
        self.modules: list[tuple[str, nn.Module]] = []  # (prefix with its trailing dot, module), pre-order
        self._records: list[tuple] = []  # per module: what `current()` compares
        self._entries: list[tuple[dict, str, object]] = []  # (dict, key, value) of every entry read
        stack = [("", module)]
        while stack:
            prefix, m = stack.pop()
            self.modules.append((prefix, m))
            params, buffers, children = m._parameters, m._buffers, m._modules
            self._records.append((m, type(m), params, buffers, children, len(params), len(buffers), len(children),
                                  frozenset(m._non_persistent_buffers_set), _hooked(m)))
            for d in (params, buffers, children):
                self._entries.extend((d, k, v) for k, v in d.items())
            stack.extend((prefix + k + ".", c) for k, c in reversed(children.items()) if c is not None)

    def current(self) -> bool:
        """Whether the module still has exactly the tree that was read (see the module docstring)."""
        for m, cls, params, buffers, children, n_params, n_buffers, n_children, non_persistent, hooked in self._records:
            if (type(m) is not cls or m._parameters is not params or m._buffers is not buffers
                    or m._modules is not children or len(params) != n_params or len(buffers) != n_buffers
                    or len(children) != n_children or m._non_persistent_buffers_set != non_persistent
                    or bool(m._state_dict_hooks or m._state_dict_pre_hooks) is not hooked):  # `_hooked`, inlined
                return False
        for d, key, value in self._entries:
            if d.get(key) is not value:
                return False
        return True

    def state_items(self) -> list[tuple[str, torch.Tensor]] | None:
        """``state_dict()``'s names and tensors as the tree reads them (the parameter and buffer objects themselves:
        detach them at each use); None where any module has state-dict behaviour of its own (hooks, or an overridden
        ``state_dict``, ``_save_to_state_dict`` or ``get_extra_state``): then only ``state_dict()`` itself says."""
        items: list[tuple[str, torch.Tensor]] = []
        for prefix, m in self.modules:
            cls = type(m)
            if (_hooked(m) or cls.state_dict is not nn.Module.state_dict
                    or cls._save_to_state_dict is not nn.Module._save_to_state_dict
                    or cls.get_extra_state is not nn.Module.get_extra_state):
                return None
            items.extend((prefix + k, p) for k, p in m._parameters.items() if p is not None)
            items.extend((prefix + k, b) for k, b in m._buffers.items()
                         if b is not None and k not in m._non_persistent_buffers_set)
        return items

    def unique_modules(self) -> list[tuple[str, nn.Module]]:
        """Each module once, under the first name it was found at (`named_modules()`'s names and order)."""
        seen: set[int] = set()
        out = []
        for prefix, m in self.modules:
            if id(m) not in seen:  # a shared module's children were all seen with it
                seen.add(id(m))
                out.append((prefix, m))
        return out


def _hooked(m: nn.Module) -> bool:
    """Whether `m` has state-dict hooks (then `state_dict()` may differ from what a walk of the tree reads)."""
    return bool(m._state_dict_hooks or m._state_dict_pre_hooks)
