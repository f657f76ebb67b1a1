"""The documentation site builds with `mkdocs build --strict` (no broken link or anchor, no page left out of the
navigation, every config key described), the README's links point at files that exist, and the version is written
in one place (omniroll/__init__.py, which pyproject.toml reads and CHANGELOG.md's newest section names)."""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

import omniroll

ROOT = Path(__file__).resolve().parent.parent


def test_docs_site_builds_strict(tmp_path):
    pytest.importorskip("mkdocs")
    pytest.importorskip("material")
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    config_page = (tmp_path / "site" / "reference" / "config" / "index.html").read_text()
    # the generated references carry every key and every command, as the code has them
    for key in ("pipeline.height", "trainer.algorithm_options", "reward.functions.&lt;name&gt;.weight", "--model"):
        assert key in config_page, key
    cli_page = (tmp_path / "site" / "reference" / "cli" / "index.html").read_text()
    from omniroll.cli import COMMANDS
    for command in COMMANDS:
        assert f"omniroll {command}" in cli_page, command


def test_readme_links_point_at_files_that_exist():
    text = (ROOT / "README.md").read_text()
    links = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text)
    local = [link for link in links if "://" not in link]
    assert local, "the README links its pages"
    missing = [link for link in local if not (ROOT / link).exists()]
    assert not missing, f"README.md links to files that do not exist: {missing}"


def test_the_version_is_written_in_one_place():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert "version" not in project and "version" in project["dynamic"]
    assert tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["dynamic"]["version"] == {
        "attr": "omniroll.__version__"}
    newest = re.search(r"^## (\S+)", (ROOT / "CHANGELOG.md").read_text(), re.M).group(1)
    assert newest == omniroll.__version__, (f"CHANGELOG.md's newest section is {newest}, omniroll is "
                                            f"{omniroll.__version__}")
    from importlib.metadata import version
    assert version("omniroll") == omniroll.__version__, "reinstall (pip install -e .): the installed metadata is stale"
