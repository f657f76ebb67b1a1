"""Shared fixtures: one tiny SD3 checkpoint and one Ray local cluster per test session (per pytest-xdist worker under
`make test`)."""

from __future__ import annotations

import os
import signal
import tempfile

import pytest
import torch

torch.set_num_threads(min(2, os.cpu_count() or 1))
# Tests send Ctrl-C (SIGINT) to the CLI, in this process and in subprocesses. A shell starts a background job with
# SIGINT ignored, and Python then keeps it ignored, so `make test &` would make those tests fail for the harness's
# sake: take SIGINT back here (the subprocesses' Pythons then start with their usual KeyboardInterrupt too).
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)
# engines calibrate their forward rows (max_batch_size="auto") into this cache: one per test session, never ~/.cache
os.environ.setdefault("OMNIROLL_CACHE_DIR", tempfile.mkdtemp(prefix="omniroll-test-cache-"))


@pytest.fixture(scope="session")
def tiny_sd3_path(tmp_path_factory):
    from omniroll.models.tiny import build_tiny_sd3

    return build_tiny_sd3(str(tmp_path_factory.mktemp("tiny-sd3")), seed=0)


@pytest.fixture(scope="module")
def engine(tiny_sd3_path):
    """The tiny SD3 on an engine of 16 forward rows a step (prefix sharing on), one per test module; a module that
    needs another engine defines its own `engine`."""
    from omniroll.engine.engine import DiffusionEngine

    eng = DiffusionEngine.from_pretrained(tiny_sd3_path, max_batch_size=16)
    yield eng
    eng.shutdown()


@pytest.fixture(scope="module")
def alone(tiny_sd3_path):
    """`alone(request)`: the request run on its own, on an engine without prefix sharing (what a shared or batched
    run must equal bitwise); each request run once per module (keyed by all but its id)."""
    from omniroll.engine.engine import DiffusionEngine

    eng = DiffusionEngine.from_pretrained(tiny_sd3_path, prefix_sharing=False)
    cache = {}

    def run(r):
        key = r.model_dump_json(exclude={"request_id"})
        if key not in cache:
            cache[key] = eng.generate([r])[0]
        return cache[key]

    yield run
    eng.shutdown()


@pytest.fixture
def torch_threads():
    """Puts torch's thread count back after a test that changes it (an engine with row threads, or a benchmark that
    sets each contender's count, runs torch at another count than the suite's)."""
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def ray_cluster():
    ray = pytest.importorskip("ray")
    if not ray.is_initialized():
        ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    yield ray
    ray.shutdown()


#: fixtures that start Ray: a test using one, directly or through another fixture (its whole closure), is
#: `slow` without having to say so. `ray_cluster` is the session's local cluster (replicas, workers, trainers build on
#: it); `nodes` (test_multinode.py) and `two_nodes` (test_train_dp_full.py) are multi-raylet clusters of their own.
SLOW_FIXTURES = frozenset({"ray_cluster", "nodes", "two_nodes"})


def pytest_collection_modifyitems(config, items):
    """Mark `slow` every test whose fixtures (their whole closure) start Ray (`make test-fast` leaves them out)."""
    for item in items:
        if SLOW_FIXTURES.intersection(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slow)


@pytest.fixture(scope="module")
def readme_envs(tiny_sd3_path, ray_cluster, tmp_path_factory):
    """The docs' blocks' environments, one per group of pages (tests/docs_blocks.py `group_envs`), for the files that
    run them (tests/test_readme.py, test_readme_pages_1.py, _2.py)."""
    from docs_blocks import group_envs

    return group_envs(tiny_sd3_path, ray_cluster, tmp_path_factory)
