"""`omniroll doctor`: checks this installation before a long run (Python, omniroll's dependencies at the versions it
accepts, its optional extras, torch and its devices, the shipped shapes and shapes-video models' files, the cache
directories, Ray)
and prints one line per check; exit 1 when one fails.

A check is `ok`, `warn` (works, but read the line), `fail` (something omniroll needs is missing or broken) or `off`
(an optional part that is not installed; the line says what needs it and how to install it).
"""

from __future__ import annotations

import json
import os
import platform
import re
import shutil
import sys
from dataclasses import asdict, dataclass
from typing import Callable, Optional

HELP = ("check the installation: dependencies and their versions, extras, torch and its devices, the shapes model, "
        "the caches, Ray")

#: what each optional extra of omniroll's package is for (`pip install 'omniroll[<extra>]'`)
EXTRA_USES = {
    "ray": "replicas, `omniroll rollout`, `train` and `serve`",
    "server": "`omniroll serve`",
    "video": "MP4 output; without it videos are written as animated WebP",
    "ocr": "the `ocr` reward",
    "verl": "the verl / VeRL-Omni bridge (`make test` installs verl with --no-deps)",
    "tensorboard": "trainer.logger tensorboard",
    "wandb": "trainer.logger wandb",
    "mlflow": "trainer.logger mlflow",
    "swanlab": "trainer.logger swanlab",
    "tracking": "the trackers `make test` checks",
    "docs": "the docs site (`mkdocs serve`)",
    "dev": "the test suite",
}
STATUSES = ("ok", "warn", "fail", "off")


@dataclass(frozen=True)
class Check:
    name: str
    status: str  # one of STATUSES
    detail: str


def add_arguments(parser) -> None:
    parser.add_argument("--ray", action="store_true",
                        help="also start a local Ray cluster and run one task on it (a few seconds)")
    parser.add_argument("--json", action="store_true", help="print the checks as one JSON line instead of a table")


def installed_version(name: str) -> Optional[str]:
    """The installed distribution's version, or None."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(name)
    except PackageNotFoundError:
        return None


def dependency_checks(requirements: list[str], installed: Callable[[str], Optional[str]]) -> list[Check]:
    """One check for the required dependencies and one per extra, from requirement strings as the package metadata
    writes them (`peft>=0.13`, `av>=12; extra == "video"`) and `installed(name)` (a version or None)."""
    from packaging.requirements import Requirement

    def problem(req: Requirement) -> Optional[str]:
        have = installed(req.name)
        if have is None:
            return f"{req.name} missing (omniroll needs {req.name}{req.specifier})"
        if req.specifier and not req.specifier.contains(have, prereleases=True):
            return f"{req.name} {have} installed, omniroll needs {req.name}{req.specifier}"
        return None

    required, extras = [], {}
    for line in requirements:
        req = Requirement(line)
        extra = re.search(r"extra\s*==\s*['\"]([^'\"]+)['\"]", str(req.marker or ""))
        (extras.setdefault(extra.group(1), []) if extra else required).append(req)
    bad = [p for p in map(problem, required) if p]
    checks = [Check("dependencies", "fail", "; ".join(bad) + " (pip install -e . in the repository, or make install)")
              if bad else Check("dependencies", "ok", f"{len(required)} of {len(required)} at versions omniroll "
                                                      f"accepts")]
    for extra, reqs in extras.items():
        problems = [p for p in map(problem, reqs) if p]
        use = EXTRA_USES.get(extra, "")
        if not problems:
            have = ", ".join(f"{r.name} {installed(r.name)}" for r in reqs[:3]) + (", ..." if len(reqs) > 3 else "")
            checks.append(Check(f"extra {extra}", "ok", have))
        elif all(installed(r.name) is None for r in reqs):
            checks.append(Check(f"extra {extra}", "off", f"not installed ({use}): pip install 'omniroll[{extra}]'"))
        else:
            checks.append(Check(f"extra {extra}", "warn", f"{'; '.join(problems)} ({use})"))
    return checks


def omniroll_check() -> Check:
    import omniroll

    meta = installed_version("omniroll")
    where = os.path.dirname(os.path.abspath(omniroll.__file__))
    if meta != omniroll.__version__:
        return Check("omniroll", "warn", f"{omniroll.__version__} at {where}, but the installed metadata says {meta}: "
                                         f"reinstall (pip install -e .)")
    return Check("omniroll", "ok", f"{omniroll.__version__} at {where}")


def torch_check() -> Check:
    import torch

    build = f"CUDA {torch.version.cuda} build" if torch.version.cuda else "CPU build"
    threads = f"{torch.get_num_threads()} threads (OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')})"
    if torch.cuda.is_available():
        gpus = [torch.cuda.get_device_properties(i) for i in range(torch.cuda.device_count())]
        names = ", ".join(f"{g.name} ({g.total_memory / 2**30:.0f} GiB)" for g in gpus)
        return Check("torch", "ok", f"{torch.__version__}, {build}, {len(gpus)} GPU(s): {names}; {threads}")
    if torch.version.cuda:
        return Check("torch", "warn", f"{torch.__version__}, {build} but no GPU visible: everything runs on the CPU "
                                      f"(a CUDA wheel is several GB; the Makefile installs torch==2.13.0, a CPU "
                                      f"build where there is no GPU); {threads}")
    return Check("torch", "ok", f"{torch.__version__}, {build}, no GPU: everything runs on the CPU; {threads}")


def shapes_model_check(path: Optional[str] = None) -> Check:
    """The shapes model's files against its SHA256SUMS (the shipped checkpoint unless `path`)."""
    from omniroll.models.shapes import CHECKPOINT, REMAKE, WHAT

    return shipped_files_check("shapes model", path or CHECKPOINT, WHAT, REMAKE)


def shapes_video_model_check(path: Optional[str] = None) -> Check:
    """The shapes-video model's files against its SHA256SUMS (the shipped checkpoint unless `path`); `off` while none
    is shipped (`make shapes-video-model` makes and installs it)."""
    from omniroll.models.shapes_video import CHECKPOINT, REMAKE, WHAT
    from omniroll.models.shipped import SUMS_FILE

    path = path or CHECKPOINT
    if not os.path.isfile(os.path.join(path, SUMS_FILE)):
        return Check("shapes-video model", "off", f"not shipped yet (--model shapes-video): `{REMAKE}` makes and "
                                                  f"installs it; a checkpoint directory works as --model meanwhile")
    return shipped_files_check("shapes-video model", path, WHAT, REMAKE)


def shipped_files_check(name: str, path: str, what: str, remake: str) -> Check:
    """Check `name`: the files at `path` against their SHA256SUMS, every file read now (`omniroll.models.shipped.
    verified`); `fail` naming what is missing or changed."""
    from omniroll.models.shipped import SUMS_FILE, verified

    try:
        verified(path, what, remake)
    except FileNotFoundError as e:
        return Check(name, "fail", str(e))
    with open(os.path.join(path, SUMS_FILE)) as f:
        n = sum(1 for line in f if line.strip())
    return Check(name, "ok", f"{n} files match {SUMS_FILE} ({path})")


def cache_checks() -> list[Check]:
    """The two cache directories: writable (or creatable: the nearest existing parent is), and their disk's free
    space. Nothing is created."""
    from omniroll.cli.common import directory_problem, nearest_existing
    from omniroll.files import cache_dir, tiny_model_cache_dir

    out = []
    for name, path, what in (("cache", cache_dir(), "$OMNIROLL_CACHE_DIR: kept evaluations, engine calibrations"),
                             ("tiny models", os.path.abspath(tiny_model_cache_dir()),
                              "$OMNIROLL_CACHE: the tiny checkpoints `--model tiny` builds")):
        problem = directory_problem(path)
        if problem:
            out.append(Check(name, "fail", f"{path} {problem}; {what}"))
            continue
        existing = nearest_existing(path)
        free = shutil.disk_usage(existing).free / 2**30
        state = "writable" if existing == os.path.abspath(path) else "to be created, writable"
        out.append(Check(name, "ok" if free >= 1 else "warn", f"{path}, {state}, {free:.1f} GiB free ({what})"))
    return out


def ray_check(start: bool) -> Check:
    try:
        import ray
    except ImportError:
        return Check("ray", "off", f"not installed ({EXTRA_USES['ray']}): pip install 'omniroll[ray]'")
    if not start:
        return Check("ray", "ok", f"{ray.__version__} (`omniroll doctor --ray` starts a local cluster and runs a task)")
    started = not ray.is_initialized()
    try:
        if started:
            ray.init(address="local", num_cpus=1, include_dashboard=False, log_to_driver=False,
                     configure_logging=False)
        value = ray.get(ray.remote(lambda: 40 + 2).remote(), timeout=120)
        nodes = len([n for n in ray.nodes() if n.get("Alive")])
    except Exception as e:  # noqa: BLE001 - what went wrong is the check's finding
        return Check("ray", "fail", f"{ray.__version__}: a local cluster did not run a task: {type(e).__name__}: {e}")
    finally:
        if started and ray.is_initialized():
            ray.shutdown()
    if value != 42:
        return Check("ray", "fail", f"{ray.__version__}: a task returned {value!r} instead of 42")
    return Check("ray", "ok", f"{ray.__version__}: a local cluster ran a task ({nodes} node)")


def run_checks(start_ray: bool = False) -> list[Check]:
    from importlib.metadata import requires

    py = platform.python_version()
    checks = [Check("python", "ok" if sys.version_info >= (3, 10) else "fail", f"{py} (omniroll needs >= 3.10)"),
              omniroll_check()]
    checks += dependency_checks(requires("omniroll") or [], installed_version)
    checks += [torch_check(), shapes_model_check(), shapes_video_model_check(), *cache_checks(), ray_check(start_ray)]
    return checks


def run(args) -> int:
    from omniroll.cli import CommandFailed

    checks = run_checks(start_ray=args.ray)
    if args.json:
        print(json.dumps({"checks": [asdict(c) for c in checks]}))
    else:
        print(f"omniroll doctor: Python {platform.python_version()}, {platform.system()} {platform.machine()}, "
              f"{os.cpu_count()} CPUs")
        width = max(len(c.name) for c in checks)
        for c in checks:
            print(f"  {c.status:<4}  {c.name:<{width}}  {c.detail}")
    failed = [c for c in checks if c.status == "fail"]
    if failed:
        raise CommandFailed([f"{c.name}: {c.detail}" for c in failed])
    if not args.json:
        off = sum(c.status == "off" for c in checks)
        warn = sum(c.status == "warn" for c in checks)
        print(f"no check failed ({warn} warning(s), {off} optional part(s) not installed)")
    return 0
