"""A script of benchmarks/ loaded as a module for a test, with benchmarks/ on sys.path while it is in use (the
scripts import benchmarks/_common.py as `_common`)."""

import contextlib
import importlib.util
import os
import sys

BENCHMARKS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks")


@contextlib.contextmanager
def benchmark_script(name: str):
    """benchmarks/<name>.py as a module (named `<name>_script`)."""
    sys.path.insert(0, BENCHMARKS)
    try:
        spec = importlib.util.spec_from_file_location(f"{name}_script", os.path.join(BENCHMARKS, f"{name}.py"))
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        yield mod
    finally:
        sys.path.remove(BENCHMARKS)
