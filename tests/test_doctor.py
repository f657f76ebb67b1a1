"""`omniroll doctor` (omniroll/cli/doctor.py): this test environment reads healthy, each kind of problem (a missing
or too old dependency, a partly installed extra, a changed file of the shapes model, a cache directory that cannot be
written) is named with what to do, a failed check exits 1, and `--ray` runs a task on a real local Ray cluster."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from omniroll.cli import main
from omniroll.cli.doctor import STATUSES, dependency_checks, shapes_model_check


def test_this_installation_reads_healthy(capsys):
    assert main(["doctor", "--json"]) == 0
    checks = json.loads(capsys.readouterr().out)["checks"]
    by_name = {c["name"]: c for c in checks}
    names = {"python", "omniroll", "dependencies", "torch", "shapes model", "cache", "tiny models", "ray"}
    assert names <= set(by_name)
    assert all(c["status"] in STATUSES for c in checks)
    assert [c["name"] for c in checks if c["status"] == "fail"] == []
    assert by_name["dependencies"]["status"] == "ok" and by_name["shapes model"]["status"] == "ok"
    assert by_name["extra dev"]["status"] == "ok"  # pytest and ruff run this suite


def test_dependency_problems_name_the_package_and_the_version_omniroll_needs():
    installed = {"peft": "0.12.0", "numpy": "2.1.0", "fastapi": "0.100.0", "uvicorn": "0.30.0", "ray": "2.60.0"}
    checks = {c.name: c for c in dependency_checks(
        ["peft>=0.13", "numpy>=1.26", "tensordict>=0.6",
         'fastapi>=0.110; extra == "server"', 'uvicorn>=0.29; extra == "server"',
         'av>=12; extra == "video"', 'ray>=2.40; extra == "ray"'], installed.get)}
    deps = checks["dependencies"]
    assert deps.status == "fail"
    assert "peft 0.12.0 installed, omniroll needs peft>=0.13" in deps.detail
    assert "tensordict missing (omniroll needs tensordict>=0.6)" in deps.detail and "numpy" not in deps.detail
    assert checks["extra server"].status == "warn" and "fastapi 0.100.0 installed" in checks["extra server"].detail
    assert checks["extra video"].status == "off" and "pip install 'omniroll[video]'" in checks["extra video"].detail
    assert checks["extra ray"].status == "ok" and checks["extra ray"].detail == "ray 2.60.0"
    assert dependency_checks(["numpy>=1.26"], installed.get)[0].status == "ok"


def test_a_changed_or_missing_file_of_the_shapes_model_fails_naming_it(tmp_path):
    from omniroll.models.shapes import CHECKPOINT

    copy = tmp_path / "checkpoint"
    shutil.copytree(CHECKPOINT, copy, ignore=shutil.ignore_patterns("evaluations", "transformer", "vae", "text_*"))
    sums = (copy / "SHA256SUMS").read_text().splitlines()
    (copy / "SHA256SUMS").write_text("".join(line + "\n" for line in sums
                                             if "/" not in line.split("  ", 1)[1]))  # the copied files only
    assert shapes_model_check(str(copy)).status == "ok"
    with open(copy / "model_index.json", "a") as f:
        f.write(" ")
    check = shapes_model_check(str(copy))
    assert check.status == "fail" and "model_index.json" in check.detail and "make shapes-model" in check.detail
    os.remove(copy / "SHA256SUMS")
    assert "missing its SHA256SUMS" in shapes_model_check(str(copy)).detail


def test_a_failed_check_exits_1_naming_it(tmp_path, monkeypatch, capsys):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("OMNIROLL_CACHE_DIR", str(blocker / "cache"))
    assert main(["doctor"]) == 1
    out, err = capsys.readouterr()
    assert "fail  cache" in out
    assert f"omniroll doctor: error: cache: {blocker / 'cache'} cannot be created: {blocker} is a file" in err


@pytest.mark.slow  # slow: starts Ray in a subprocess
def test_ray_flag_runs_a_task_on_a_local_cluster(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    command = [os.path.join(os.path.dirname(sys.executable), "omniroll"), "doctor", "--ray", "--json"]
    proc = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-2000:]
    ray = {c["name"]: c for c in json.loads(proc.stdout.strip().splitlines()[-1])["checks"]}["ray"]
    assert ray["status"] == "ok" and "a local cluster ran a task" in ray["detail"]
    assert not (tmp_path / ".omniroll_cache").exists()  # the doctor creates nothing
