"""Every shell and Python block of the documentation runs verbatim: README.md, CONTRIBUTING.md, CHANGELOG.md and
every page of the docs site under docs/ (a new block or page is picked up automatically).

Convention (also stated in CONTRIBUTING.md):
- Each ```bash / ```sh / ```shell and ```python block is run as it stands: shell blocks with `bash -eo pipefail`,
  Python blocks each in a fresh interpreter (so every Python block must be self-contained). Lines that run `make`
  are left out (`make demo` / `make test` install things; CI runs them separately).
- The files run in DOC_FILES' order and each file's blocks top to bottom, in one scratch directory: a block may read
  what an earlier block wrote (the README's shapes run, which the evaluation page evaluates).
- Blocks run in a scratch directory that holds a link to the repository's `examples/`, with the console scripts of
  this interpreter on PATH, `OMNIROLL_CACHE` pointing at the session's tiny model, Ray commands attached to the
  test session's Ray cluster (`RAY_ADDRESS`, never a second cluster), and the environment variable CONTRIBUTING.md
  states for small settings: `OMNIROLL_OVERRIDES` (config overrides every omniroll command applies last).
- A block that cannot run here (it needs a GPU, a real checkpoint, a server that runs forever, network) is marked by
  an HTML comment on the line(s) right before it: `<!-- readme-test: skip: <reason> -->`. The reason is required.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
#: the files whose blocks run: the README, the project files and every page of the docs site
DOC_FILES = ([ROOT / "README.md", ROOT / "CONTRIBUTING.md", ROOT / "CHANGELOG.md"]
             + sorted(p for p in (ROOT / "docs").rglob("*.md") if "hooks" not in p.parts))

#: small settings for every omniroll command a README block runs (CONTRIBUTING.md states this variable)
SMALL = ("pipeline.height=64 pipeline.width=64 pipeline.num_inference_steps=4 pipeline.max_sequence_length=12 "
         "algo.sde_window_size=2 algo.sde_window_range=[0,3] replicas.count=1 reward.num_workers=1 "
         "agent.num_workers=1 n=2")
# a block of `omniroll train` commands also trains 2 steps (a key only the train config has)
SMALL_TRAIN = SMALL + " trainer.steps=2"
#: what a training config's own sections need on top: a forward-process algorithm (nft, awm) records no SDE window,
#: so the window keys are left out; a task evaluation draws one picture per prompt
SDE_KEYS = "algo.sde_window_size=2 algo.sde_window_range=[0,3] "
SMALL_EVAL = " trainer.evaluation.seeds=1 trainer.evaluation.beside_seeds=1"


def small_overrides(code: str) -> str:
    """The block's OMNIROLL_OVERRIDES: SMALL, or SMALL_TRAIN for a block of `omniroll train` commands; without the
    SDE window keys when a config the block names (`--config`) trains a forward-process algorithm (nft, awm: no
    window); with SMALL_EVAL for a training block whose config has a task evaluation."""
    import yaml

    train = "omniroll train" in code
    out = SMALL_TRAIN if train else SMALL
    for path in re.findall(r"--config\s+(\S+)", code):
        file = ROOT / path
        trainer = ((yaml.safe_load(file.read_text()) or {}).get("trainer") or {}) if file.is_file() else {}
        if trainer.get("algorithm") in ("nft", "awm"):
            out = out.replace(SDE_KEYS, "")
        if train and trainer.get("evaluation") and SMALL_EVAL not in out:
            out += SMALL_EVAL
    return out


_FENCE = re.compile(r"^```(\w+)?\s*$")
_SKIP = re.compile(r"<!--\s*readme-test:\s*skip\s*:?\s*(.*?)\s*-->")
_LANGS = {"bash": "sh", "sh": "sh", "shell": "sh", "console": "sh", "python": "python", "py": "python"}


def readme_blocks(text: str) -> list[dict]:
    """[{"lang": "sh" | "python", "code", "line", "skip": reason or None}] for every shell / Python block."""
    blocks, lines, i = [], text.splitlines(), 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        start, lang = i, (m.group(1) or "").lower()
        j = i + 1
        while j < len(lines) and not lines[j].startswith("```"):
            j += 1
        k = start - 1
        while k >= 0 and not lines[k].strip():
            k -= 1
        skip = _SKIP.search(lines[k]) if k >= 0 else None
        if lang in _LANGS:
            blocks.append({"lang": _LANGS[lang], "code": "\n".join(lines[start + 1:j]), "line": start + 1,
                           "skip": skip.group(1) if skip else None})
        i = j + 1
    return blocks


def without_make(code: str) -> str:
    """Drop `make ...` commands (with their backslash continuations)."""
    out, dropping = [], False
    for line in code.splitlines():
        if dropping or re.match(r"^\s*make(\s|$)", line):
            dropping = line.rstrip().endswith("\\")
            continue
        out.append(line)
    return "\n".join(out)


BLOCKS = [dict(b, file=str(path.relative_to(ROOT))) for path in DOC_FILES for b in readme_blocks(path.read_text())]


def test_readme_has_blocks_and_every_skip_gives_a_reason():
    assert any(b["lang"] == "python" for b in BLOCKS) and any(b["lang"] == "sh" for b in BLOCKS)
    for b in BLOCKS:
        assert b["skip"] is None or b["skip"].strip(), f"{b['file']}:{b['line']}: a skipped block needs a reason"


def test_block_parser_convention():
    text = ("x\n```bash\nmake demo\nomniroll demo \\\n  --out o\nmake test \\\n  -j2\necho hi\n```\n"
            "<!-- readme-test: skip: needs a GPU -->\n\n```python\nprint(1)\n```\n```text\nno\n```\n")
    blocks = readme_blocks(text)
    assert [(b["lang"], b["skip"]) for b in blocks] == [("sh", None), ("python", "needs a GPU")]
    assert without_make(blocks[0]["code"]) == "omniroll demo \\\n  --out o\necho hi"


@pytest.fixture(scope="module")
def readme_env(tiny_sd3_path, ray_cluster, tmp_path_factory):
    work = tmp_path_factory.mktemp("readme")
    (work / "examples").symlink_to(ROOT / "examples")
    cache = work / "cache"
    cache.mkdir()
    (cache / "tiny-sd3").symlink_to(tiny_sd3_path)
    env = dict(os.environ)
    env.update({
        "PATH": os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", ""),
        "PYTHONPATH": str(ROOT) + os.pathsep + env.get("PYTHONPATH", ""),
        "OMNIROLL_CACHE": str(cache),
        "OMNIROLL_OVERRIDES": SMALL,
        "RAY_ADDRESS": ray_cluster.get_runtime_context().gcs_address,
        "OMP_NUM_THREADS": env.get("OMP_NUM_THREADS", "2"),
    })
    return work, env


@pytest.mark.parametrize("block", BLOCKS, ids=[f"{b['file']}:{b['line']}-{b['lang']}" for b in BLOCKS])
def test_readme_block_runs_verbatim(block, readme_env):
    if block["skip"] is not None:
        pytest.skip(f"{block['file']}:{block['line']}: {block['skip']}")
    work, env = readme_env
    if block["lang"] == "sh":
        code = without_make(block["code"])
        if not code.strip() or all(line.strip().startswith("#") for line in code.splitlines() if line.strip()):
            pytest.skip("only make lines")
        cmd = ["bash", "-eo", "pipefail", "-c", code]
        env = {**env, "OMNIROLL_OVERRIDES": small_overrides(code)}
    else:
        cmd = [sys.executable, "-c", block["code"]]
    proc = subprocess.run(cmd, cwd=work, env=env, capture_output=True, text=True, timeout=BLOCK_TIMEOUT_S)
    assert proc.returncode == 0, (f"{block['file']}:{block['line']} ({block['lang']}) exited {proc.returncode}\n"
                                  f"--- stdout ---\n{proc.stdout[-3000:]}\n--- stderr ---\n{proc.stderr[-5000:]}")
