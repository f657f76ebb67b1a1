"""The package edges: every omniroll module imports only its own layer and the layers below it (docs/design.md),
module-level imports and the imports inside functions alike."""

import ast
import os

ROOT = os.path.join(os.path.dirname(__file__), "..", "omniroll")

#: top-level package or module -> its layer (docs/design.md; leaf modules at 0, beside-layers between)
LAYER = {"errors": 0, "files": 0, "library_warnings": 0, "media": 0, "ray_nodes": 0,
         "sampling": 1, "tasks": 1, "models": 2, "weights": 3, "engine": 4, "rollout": 5, "reward": 6,
         "config": 6.5, "agent_loop": 7, "trajectory_file": 7, "evaluation": 7.5, "train": 8,
         "integrations": 9, "cli": 9, "http": 9}


def imports_of(path: str):
    for node in ast.walk(ast.parse(open(path).read())):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("omniroll."):
            yield node.lineno, node.module
        elif isinstance(node, ast.Import):
            yield from ((node.lineno, a.name) for a in node.names if a.name.startswith("omniroll."))


def test_every_import_points_down_the_layers():
    upward, unknown = [], set()
    for folder, _, files in os.walk(ROOT):
        for name in files:
            if not name.endswith(".py"):
                continue
            path = os.path.join(folder, name)
            rel = os.path.relpath(path, ROOT).split(os.sep)
            if rel == ["__init__.py"]:
                continue  # the package's lazy public names
            own = rel[0].removesuffix(".py")
            if own not in LAYER:
                unknown.add(own)
                continue
            for line, module in imports_of(path):
                target = module.split(".")[1]
                if LAYER.get(target, -1) > LAYER[own]:
                    upward.append(f"{'/'.join(rel)}:{line} imports {module}")
    assert not unknown, f"packages with no layer in this test and docs/design.md: {sorted(unknown)}"
    assert not upward, upward
