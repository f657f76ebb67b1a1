"""Checks against VeRL-Omni's REAL sources, run when VERL_OMNI_SRC points at a VeRL-Omni checkout (tested layout:
a1139ba). VeRL-Omni is on no package registry and cannot be imported without vllm-omni, so CI skips this file; the
docs/verl.md gives the commands. The sources are read, not installed: each check finds what it
needs by name in the tree and runs the self-contained functions on their own, so it does not depend on file layout.

- every attribute VeRL-Omni's actor `update_weights` reads on its rollout (`self.rollout.X`) exists on
  `OmnirollServerAdapter`;
- every keyword VeRL-Omni passes to `_execute_method("update_weights_from_ipc", kwargs={...})` is accepted by
  `OmnirollServer.update_weights_from_ipc`;
- VeRL-Omni's per-update ZMQ socket naming (`make_update_zmq_handle` / `make_update_zmq_id`) gives the sockets
  omniroll's receiver listens on (`lora_sync.update_zmq_handle`);
- VeRL-Omni's seed derivation (the function with its 1_000_003 multiplier) gives level B's seeds (`verl_omni_seed`).
"""

import ast
import inspect
import os
import pathlib

import pytest

SRC = os.environ.get("VERL_OMNI_SRC")
pytestmark = pytest.mark.skipif(
    not SRC, reason="VERL_OMNI_SRC is not set: VeRL-Omni is on no package registry and CI cannot fetch it; set "
                    "VERL_OMNI_SRC=/path/to/verl-omni (a checkout) to check omniroll against its real sources")
pytest.importorskip("verl")

STDLIB_PRELUDE = "import os, re, uuid, time, hashlib, itertools\nfrom typing import *\n"


def _trees():
    root = pathlib.Path(SRC)
    pkg = root / "verl_omni" if (root / "verl_omni").is_dir() else root
    for path in sorted(pkg.rglob("*.py")):
        try:
            yield path, ast.parse(path.read_text())
        except SyntaxError:
            continue


def _functions(name_filter):
    for path, tree in _trees():
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and name_filter(node):
                yield path, node


def _standalone(node):
    """The function on its own (decorators dropped, stdlib imports only), as a callable."""
    node = ast.parse(ast.unparse(node)).body[0]
    node.decorator_list = []
    ns: dict = {}
    exec(compile(STDLIB_PRELUDE + ast.unparse(node), "<verl_omni>", "exec"), ns)
    return ns[node.name]


def _rollout_attrs(fn) -> set[str]:
    out = set()
    for n in ast.walk(fn):
        if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Attribute) and n.value.attr == "rollout" \
                and isinstance(n.value.value, ast.Name) and n.value.value.id == "self":
            out.add(n.attr)
    return out


def test_actor_update_weights_reads_only_what_the_adapter_has(ray_cluster, tiny_sd3_path):
    import omniroll.integrations.verl as ov
    from tests.verl_helpers import verl_config

    fns = list(_functions(lambda f: f.name == "update_weights" and "rollout" in ast.unparse(f)))
    assert fns, f"no update_weights reading self.rollout under {SRC}"
    cfg = verl_config(tiny_sd3_path)
    adapter = ov.OmnirollServerAdapter(cfg.actor_rollout_ref.rollout, cfg.actor_rollout_ref.model, None,
                                       replica_rank=0)
    missing = {f"{p.name}:{f.lineno} self.rollout.{a}" for p, f in fns for a in _rollout_attrs(f)
               if not hasattr(adapter, a)}
    assert not missing, f"VeRL-Omni reads attributes OmnirollServerAdapter lacks: {sorted(missing)}"


def test_update_weights_from_ipc_kwargs_are_accepted():
    from omniroll.integrations.verl import OmnirollServer

    accepted = set(inspect.signature(OmnirollServer.update_weights_from_ipc).parameters) - {"self"}
    sent: dict[str, set] = {}
    for path, tree in _trees():
        for n in ast.walk(tree):
            is_call = isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
            if not (is_call and n.func.attr == "_execute_method" and n.args and isinstance(n.args[0], ast.Constant)
                    and n.args[0].value == "update_weights_from_ipc"):
                continue
            for kw in n.keywords:
                if kw.arg == "kwargs" and isinstance(kw.value, ast.Dict):
                    keys = {k.value for k in kw.value.keys if isinstance(k, ast.Constant)}
                    sent[f"{path.name}:{n.lineno}"] = keys - accepted
    assert sent, f"no _execute_method('update_weights_from_ipc', kwargs={{...}}) call under {SRC}"
    bad = {where: keys for where, keys in sent.items() if keys}
    assert not bad, f"keywords OmnirollServer.update_weights_from_ipc does not take: {bad}"


def test_per_update_zmq_socket_names_agree():
    from omniroll.integrations.verl.lora_sync import update_zmq_handle, zmq_handle_for

    handles = [f for _, f in _functions(lambda f: "zmq" in f.name and "handle" in f.name and "update" in f.name)]
    ids = [f for _, f in _functions(lambda f: "zmq" in f.name and f.name.endswith("id") and "update" in f.name)]
    assert handles, f"no function naming per-update ZMQ handles (make_update_zmq_handle) under {SRC}"
    make_handle = _standalone(handles[0])
    make_id = _standalone(ids[0]) if ids else (lambda step, seq: f"step-{step}-seq-{seq}")
    base = zmq_handle_for("02000000", 1)
    for step, seq in ((1, 0), (7, 3)):
        update_id = make_id(step, seq)
        assert make_handle(base, update_id) == update_zmq_handle(base, update_id), (step, seq, update_id)
    assert make_handle("tcp://127.0.0.1:5555", make_id(1, 0)) == update_zmq_handle("tcp://127.0.0.1:5555", "x")


def test_seeds_agree_with_verl_omni():
    from omniroll.integrations.verl.seeds import verl_omni_seed

    fns = [f for p, f in _functions(lambda f: "1_000_003" in ast.unparse(f) or "1000003" in ast.unparse(f))
           if "agent_loop" in str(p)]
    assert fns, f"no seed derivation (multiplier 1_000_003) under {SRC}/verl_omni/agent_loop"
    derive = _standalone(fns[0])
    params = list(inspect.signature(derive).parameters)
    for seed, step, idx in ((3, 1, 0), (3, 1, 5), (42, 7, 31), (0, 1, 2)):
        if len(params) >= 3:
            got = derive(seed, step, idx)
        else:  # (base, idx): base = rollout.seed + global_steps - 1
            got = derive(seed + step - 1, idx)
        assert got == verl_omni_seed(seed, step, idx), (fns[0].name, params, seed, step, idx)
