"""The docs build's "Last updated" line: each page ends with the date of the last commit that changed its Markdown
file (`git log`), so a reader sees how old what they read is. A page with uncommitted changes says so; outside a git
checkout (a source archive) no line is added."""

from __future__ import annotations

import os
import subprocess


def last_commit_date(path: str) -> str | None:
    """The date (YYYY-MM-DD) of the last commit that changed `path`, "uncommitted changes" when the working tree
    differs from it, or None when git cannot tell (no git, no repository, a file never committed)."""
    where = os.path.dirname(os.path.abspath(path))
    try:
        date = subprocess.run(["git", "log", "-1", "--format=%cs", "--", path], cwd=where, capture_output=True,
                              text=True, timeout=30).stdout.strip()
        if not date:
            return None
        dirty = subprocess.run(["git", "diff", "--quiet", "HEAD", "--", path], cwd=where, timeout=30).returncode
    except (OSError, subprocess.SubprocessError):
        return None
    return f"{date}, with uncommitted changes" if dirty == 1 else date


def on_page_markdown(markdown, page, config, files):
    date = last_commit_date(page.file.abs_src_path)
    if date is None:
        return markdown
    return markdown.rstrip("\n") + f"\n\n---\n\n<small>Last updated: {date} (git).</small>\n"
