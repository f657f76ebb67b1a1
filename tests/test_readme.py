"""The documentation's blocks run verbatim, part 0 of tests/docs_blocks.py's split (the README's group among
them; parts 1 and 2: tests/test_readme_pages_1.py and _2.py), and the rules that runner follows: which blocks run,
which pages share a directory, how the groups are split over the files."""

from __future__ import annotations

import pytest

from docs_blocks import (BLOCKS, GROUPS, PART_OF_GROUP, PARTS, block_params, group_parts, page_groups,
                         readme_blocks, run_block, runs, shell_commands, where_each_ran_before, without_make)


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


def test_a_shell_block_whose_every_command_ran_before_is_not_run_again():
    def sh(code, line, skip=None):
        return {"lang": "sh", "code": code, "line": line, "skip": skip, "file": "a.md"}

    blocks = [sh("omniroll train --out o   # AWM\nomniroll eval o", 1),
              sh("omniroll  train --out o      # the same, another comment", 5),
              sh("omniroll train --out o\nomniroll eval o --split heldout", 9),  # one new command: runs whole
              sh("omniroll export o", 13, skip="needs a GPU"),  # a skipped block's commands never count as run
              sh("omniroll export o", 15),
              sh("omniroll eval o --split heldout", 17),  # ran in the block at line 9
              sh("# only a comment", 19), sh("make demo", 21)]
    assert shell_commands("make x \\\n  -j2\nfoo  --a \\\n  b # c\n# d") == ["foo --a b"]
    # quotes and a `#` inside a word are not comments; a here-document's lines belong to its command
    assert shell_commands('echo "x # 1"  a#b # c') == ['echo "x # 1" a#b']
    assert shell_commands("cat > f <<'EOF'\nn: 4  # four\nEOF\nls") == ["cat > f <<'EOF'\nn: 4  # four\nEOF", "ls"]
    # the same here-document lines written to another file, or in another order, are another command
    assert where_each_ran_before([sh("cat > f <<'EOF'\na\nb\nEOF", 1), sh("cat > g <<'EOF'\na\nb\nEOF", 5),
                                  sh("cat > f <<'EOF'\nb\na\nEOF", 9), sh("cat > f <<'EOF'\na\nb\nEOF", 13)]) == {
        3: "a.md:1"}
    assert where_each_ran_before(blocks) == {1: "a.md:1", 5: "a.md:9"}


def test_pages_that_share_files_are_one_group():
    """What the docs need today (the README's shapes run is evaluated on the evaluation page and repeated on getting
    started; two pages train into out/train), found from the blocks; the rule on made-up pages."""
    assert GROUPS["docs/evaluation.md"] == GROUPS["docs/getting-started.md"] == GROUPS["README.md"] == "README.md"
    assert GROUPS["docs/training/index.md"] == GROUPS["docs/export.md"]
    assert GROUPS["docs/serving.md"] == "docs/serving.md" and GROUPS["docs/howto/reward.md"] == "docs/howto/reward.md"
    for b in BLOCKS:
        if "ran_in" in b:
            assert GROUPS[b["file"]] == GROUPS[b["ran_in"].rsplit(":", 1)[0]], b["file"]

    def sh(file, code, **kw):
        return {"lang": "sh", "code": code, "line": 1, "skip": None, "file": file, **kw}

    pages = [sh("a.md", "omniroll train --out out/run"), sh("b.md", "cat > my.yaml <<'EOF'\nx: 1\nEOF"),
             sh("c.md", "omniroll eval --checkpoint out/run/checkpoints/latest --config my.yaml"),
             sh("d.md", "omniroll eval --checkpoint out/run2"), sh("e.md", "ls my.yaml.bak"),
             sh("f.md", "omniroll train --out out/run", ran_in="a.md:1")]
    assert page_groups(pages) == {"a.md": "a.md", "b.md": "a.md", "c.md": "a.md", "d.md": "d.md", "e.md": "e.md",
                                  "f.md": "a.md"}


def test_every_group_runs_in_one_part_and_the_parts_share_the_cost():
    """Each block runs in exactly one part's file, a group's blocks all in the same one; on made-up groups the
    costliest go first, each into the least loaded part; a group without a measured cost counts per block."""
    assert sorted(id(p.values[0]) for part in range(PARTS) for p in block_params(part)) == sorted(id(b) for b in BLOCKS)
    assert set(PART_OF_GROUP) == set(GROUPS.values()) and set(PART_OF_GROUP.values()) == set(range(PARTS))
    assert any(runs(b) for b in BLOCKS if PART_OF_GROUP[GROUPS[b["file"]]] == 0)

    def sh(file):
        return {"lang": "sh", "code": "omniroll x", "line": 1, "skip": None, "file": file}

    blocks = [sh("a.md"), sh("b.md"), sh("new.md"), sh("new.md"), sh("c.md"), sh("d.md")]
    groups = {"a.md": "a.md", "b.md": "b.md", "new.md": "new.md", "c.md": "c.md", "d.md": "a.md"}
    seconds = {"a.md": 500, "b.md": 300, "c.md": 100}  # new.md: 2 blocks x DEFAULT_BLOCK_S
    assert group_parts(blocks, groups, seconds, parts=2) == {"a.md": 0, "b.md": 1, "c.md": 1, "new.md": 1}
    assert group_parts(blocks, groups, {"a.md": 50, "b.md": 30, "c.md": 10}, parts=2) == {
        "new.md": 0, "a.md": 1, "b.md": 1, "c.md": 0}  # 80 | 50 + 30 | then the tie: the lower part


@pytest.mark.parametrize("block", block_params(0))
def test_readme_block_runs_verbatim(block, readme_envs):
    run_block(block, readme_envs)
