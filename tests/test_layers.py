"""The package edges: every omniroll module imports only its own layer and the layers below it (docs/design.md),
module-level imports and the imports inside functions alike; the packages of one layer import each other without a
loop; and no package imports another package's private (underscore) names or modules."""

import ast
import os

ROOT = os.path.join(os.path.dirname(__file__), "..", "omniroll")

#: top-level package or module -> its layer (docs/design.md; leaf modules at 0, beside-layers between)
LAYER = {"errors": 0, "files": 0, "library_warnings": 0, "media": 0, "ray_nodes": 0,
         "sampling": 1, "tasks": 1, "models": 2, "weights": 3, "engine": 4, "rollout": 5, "reward": 6,
         "config": 6.5, "agent_loop": 7, "trajectory_file": 7, "evaluation": 7.5, "run_rollout": 7.5, "train": 8,
         "export": 8.5, "integrations": 9, "cli": 9, "http": 9}


def imports_of(path: str):
    """(line, module, imported names) of every absolute `omniroll.*` import in the file."""
    for node in ast.walk(ast.parse(open(path).read())):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("omniroll."):
            yield node.lineno, node.module, [a.name for a in node.names]
        elif isinstance(node, ast.Import):
            yield from ((node.lineno, a.name, []) for a in node.names if a.name.startswith("omniroll."))


def modules():
    """(path relative to omniroll/ as parts, its top-level package or module) of every module but omniroll/__init__."""
    for folder, _, files in os.walk(ROOT):
        for name in files:
            if name.endswith(".py"):
                rel = os.path.relpath(os.path.join(folder, name), ROOT).split(os.sep)
                if rel != ["__init__.py"]:  # the package's lazy public names
                    yield rel, rel[0].removesuffix(".py")


def test_every_import_points_down_the_layers():
    upward, unknown = [], set()
    for rel, own in modules():
        if own not in LAYER:
            unknown.add(own)
            continue
        for line, module, _ in imports_of(os.path.join(ROOT, *rel)):
            target = module.split(".")[1]
            if LAYER.get(target, -1) > LAYER[own]:
                upward.append(f"{'/'.join(rel)}:{line} imports {module}")
    assert not unknown, f"packages with no layer in this test and docs/design.md: {sorted(unknown)}"
    assert not upward, upward


def loops(edges: dict[str, set[str]]) -> list[list[str]]:
    """The import loops of a graph (package -> packages it imports), each once, as a path that ends where it began."""
    found, seen = [], set()

    def walk(node, path):
        for nxt in sorted(edges.get(node, ())):
            if nxt in path:
                loop = path[path.index(nxt):] + [nxt]
                key = frozenset(loop)
                if key not in seen:
                    seen.add(key)
                    found.append(loop)
            else:
                walk(nxt, path + [nxt])

    for start in sorted(edges):
        walk(start, [start])
    return found


def test_the_loop_finder_finds_a_loop_among_three_packages():
    assert loops({"cli": {"http"}, "http": {"integrations"}, "integrations": {"cli"}}) == [
        ["cli", "http", "integrations", "cli"]]
    assert loops({"cli": {"http", "integrations"}, "http": {"integrations"}}) == []


def test_the_packages_of_one_layer_import_each_other_without_a_loop():
    """A layer's packages (cli, http, integrations; agent_loop and trajectory_file; sampling and tasks; the leaf
    modules) may import each other, but never in a loop: a loop would make two of them one package."""
    edges: dict[str, set[str]] = {}
    for rel, own in modules():
        for _, module, _ in imports_of(os.path.join(ROOT, *rel)):
            target = module.split(".")[1]
            if target != own and LAYER.get(target) == LAYER.get(own):
                edges.setdefault(own, set()).add(target)
    assert not loops(edges), loops(edges)


def test_no_package_imports_another_packages_private_names():
    """`from omniroll.x.y import _name` and `omniroll.x._module` from outside package x (CONTRIBUTING.md)."""
    private = []
    for rel, own in modules():
        for line, module, names in imports_of(os.path.join(ROOT, *rel)):
            parts = module.split(".")
            if parts[1] == own:
                continue
            bad = [n for n in names if n.startswith("_")] + [p for p in parts[2:] if p.startswith("_")]
            if bad:
                private.append(f"{'/'.join(rel)}:{line} imports {module}: {bad}")
    assert not private, private


def module_name(rel: list[str]) -> str:
    """`omniroll.a.b` for ["a", "b.py"], `omniroll.a` for ["a", "__init__.py"]."""
    parts = [p.removesuffix(".py") for p in rel]
    return ".".join(["omniroll", *(parts[:-1] if parts[-1] == "__init__" else parts)])


def test_no_two_files_import_each_other():
    """A loop between two files (say a package's `__init__` and one of its modules) is one the package edges cannot
    see: the layers hold, yet neither file can be read or loaded without the other."""
    names = {module_name(rel): rel for rel, _ in modules()}
    edges = set()
    for name, rel in names.items():
        for _, module, imported in imports_of(os.path.join(ROOT, *rel)):
            for target in [f"{module}.{n}" for n in imported] + [module]:
                if target in names and target != name:
                    edges.add((name, target))
                    break
    loops = sorted(f"{a} <-> {b}" for a, b in edges if (b, a) in edges and a < b)
    assert not loops, loops
