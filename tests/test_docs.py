"""The documentation site builds with `mkdocs build --strict` (no broken link or anchor, no page left out of the
navigation, every config key described); the generated pages and regions committed under docs/ are what the code
gives now (docs/hooks/generated.py), so they read on GitHub as on the site; every relative link of the docs' Markdown
points at a file of the repository (no 404 on GitHub); and the version is written in one place
(omniroll/__init__.py, which pyproject.toml reads and CHANGELOG.md's newest section names)."""

from __future__ import annotations

import importlib.util
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

import omniroll

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow  # slow: builds the site
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
    # every page ends with the date of its file's last commit, as git tells it (no line where git cannot tell)
    sys.path.insert(0, str(ROOT / "docs" / "hooks"))
    from last_updated import last_commit_date

    date = last_commit_date(str(ROOT / "docs" / "index.md"))
    home = (tmp_path / "site" / "index.html").read_text()
    assert (f"Last updated: {date} (git)" in home) if date else ("Last updated" not in home), date
    # llms.txt lists every page of the navigation, each with its address on the site and a first sentence
    from mkdocs.config import load_config

    nav = load_config(str(ROOT / "mkdocs.yml"))["nav"]

    def pages(items):
        return [p for i in items for v in (i.values() if isinstance(i, dict) else [i])
                for p in (pages(v) if isinstance(v, list) else [v])]

    llms = (tmp_path / "site" / "llms.txt").read_text().splitlines()
    assert llms[0] == "# omniroll" and llms[2].startswith("> Online RL")
    listed = [line for line in llms if line.startswith("- [")]
    assert len(listed) == len(pages(nav)) and all(re.match(r"- \[[^\]]+\]\(\S+/\): \S", line) or
                                                   line.startswith("- [Home](./): ") for line in listed), listed
    for page in pages(nav):
        url = "./" if page == "index.md" else page.removesuffix("index.md").removesuffix(".md").rstrip("/") + "/"
        assert sum(f"]({url})" in line for line in listed) == 1, page
        assert (tmp_path / "site" / url / "index.html").is_file(), url


def _generated():
    """docs/hooks/generated.py as a module (it is a script beside the docs, not part of the package)."""
    pytest.importorskip("matplotlib")
    spec = importlib.util.spec_from_file_location("generated", ROOT / "docs" / "hooks" / "generated.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_generated_docs_are_committed_and_fresh():
    stale = _generated().stale()
    assert not stale, f"stale generated docs (run `make docs-generate` and commit): {stale}"


def test_a_stale_generated_page_or_region_is_found(tmp_path, monkeypatch):
    generated = _generated()
    shutil.copytree(ROOT / "docs", tmp_path / "docs")
    for name in ("CHANGELOG.md", "CONTRIBUTING.md"):
        shutil.copy(ROOT / name, tmp_path / name)
    monkeypatch.setattr(generated, "ROOT", tmp_path)
    monkeypatch.setattr(generated, "DOCS", tmp_path / "docs")
    assert generated.stale() == []
    config = tmp_path / "docs" / "reference" / "config.md"
    config.write_text(config.read_text().replace("| `pipeline.height` |", "| `pipeline.heightt` |"))
    nft = tmp_path / "docs" / "training" / "nft.md"
    nft.write_text(nft.read_text().replace("| `beta` |", "| `betta` |"))
    (tmp_path / "docs" / "design_layers.png").write_bytes(b"not the picture")
    with pytest.raises(Exception):  # a PNG without the inputs hash cannot even be read as one
        generated.stale()
    (tmp_path / "docs" / "design_layers.png").write_bytes((ROOT / "docs" / "design_layers.png").read_bytes())
    assert generated.stale() == ["docs/reference/config.md", "docs/training/nft.md (algorithm nft)"]
    assert sorted(generated.write()) == ["docs/reference/config.md", "docs/training/nft.md"]
    assert generated.stale() == []


#: a Markdown link or image: [text](target) / ![alt](target "title")
_LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")


def test_every_relative_link_of_the_docs_resolves_on_github():
    files = ([ROOT / "README.md", ROOT / "CONTRIBUTING.md", ROOT / "CHANGELOG.md"]
             + sorted(p for p in (ROOT / "docs").rglob("*.md") if "hooks" not in p.parts))
    broken = []
    for path in files:
        text = re.sub(r"`[^`\n]*`", "", re.sub(r"^```.*?^```", "", path.read_text(), flags=re.S | re.M))
        for target in _LINK.findall(text):
            target = target.split("#")[0]
            if target and "://" not in target and not target.startswith("mailto:"):
                if not (path.parent / target).exists():
                    broken.append(f"{path.relative_to(ROOT)}: {target}")
    assert not broken, f"links that 404 on GitHub: {broken}"


def test_every_recipe_of_the_config_cookbook_validates():
    """Each ```yaml block of docs/howto/config.md, laid over the example its first line names, is a valid config."""
    from omegaconf import OmegaConf

    from omniroll.config import load_config

    text = (ROOT / "docs" / "howto" / "config.md").read_text()
    blocks = re.findall(r"^```yaml\n(.*?)^```", text, flags=re.S | re.M)
    assert len(blocks) >= 10, "the cookbook's recipes"
    for block in blocks:
        base = re.match(r"# on top of (examples/\S+\.yaml)\n", block)
        assert base, f"a recipe must start with '# on top of examples/<name>.yaml':\n{block}"
        merged = OmegaConf.merge(OmegaConf.load(ROOT / base.group(1)), OmegaConf.create(block))
        config = OmegaConf.to_container(merged)
        if "prompts_file" in config.get("trainer", {}):  # the examples name their files relative to the repo
            config["trainer"]["prompts_file"] = str(ROOT / config["trainer"]["prompts_file"])
        for key in ("splits",):
            evaluation = config.get("trainer", {}).get("evaluation") or {}
            evaluation[key] = [str(ROOT / s) if s.endswith(".txt") else s for s in evaluation.get(key, [])]
        load_config(config)  # raises ConfigError naming the key


def test_the_which_example_table_lists_every_example_config_once():
    """docs/getting-started.md's "Which example to run" has one row per config under examples/ (first column), and
    names no config that does not exist: a new recipe cannot ship without its time and evidence."""
    text = (ROOT / "docs" / "getting-started.md").read_text()
    section = text.split("### Which example to run", 1)[1].split("\n#", 1)[0]
    rows = re.findall(r"^\| `(examples/[^`]+\.yaml)` \|", section, flags=re.M)
    shipped = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "examples").glob("*.yaml"))
    assert sorted(rows) == shipped, f"rows {sorted(rows)} against the configs {shipped}"


def test_the_status_boxes_name_the_current_version():
    """The README's and the docs home's status box say which version their claims are about: this one."""
    for page in ("README.md", "docs/index.md"):
        found = re.findall(r"Status \((\S+), (\d{4}-\d{2}-\d{2})\)", (ROOT / page).read_text())
        assert [v for v, _ in found] == [omniroll.__version__], (page, found)


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
