"""The docs build's `llms.txt` (llmstxt.org's format): the site's title and summary, then every page of the navigation
under its section, each with its link and the first sentence of its first paragraph, written at the site's root at
every build, so it lists the pages the site has."""

from __future__ import annotations

import os
import re


def first_sentence(markdown: str) -> str:
    """The first sentence of the page's first prose paragraph (headings, admonitions, tables, code and pictures
    skipped), links reduced to their text."""
    paragraph, fenced = [], False
    for line in markdown.splitlines():
        if line.startswith("```"):
            fenced = not fenced
            continue
        text = line.strip()
        if fenced or (not paragraph and (not text or text[0] in "#!|<-*>[" or line.startswith("    "))):
            continue
        if not text:
            break
        paragraph.append(text)
    prose = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", " ".join(paragraph))
    code = re.findall(r"`[^`]*`", prose)  # a sentence never ends inside inline code
    masked = re.sub(r"`[^`]*`", "\0", prose)
    sentence = re.split(r"(?<!e\.g\.)(?<!i\.e\.)(?<=[.])\s+(?=[A-Za-z(*\0])", masked, maxsplit=1)[0]
    for span in code:
        sentence = sentence.replace("\0", span, 1)
    return sentence if len(sentence) <= 240 else sentence[:237] + "..."


def entries(nav, docs_dir: str, section: str = "") -> list[tuple[str, str, str, str]]:
    """(section, title, page path, description) for every page of `nav` (mkdocs.yml's, nested), in its order."""
    out = []
    for item in nav:
        for title, value in (item.items() if isinstance(item, dict) else [(None, item)]):
            if isinstance(value, list):
                out += entries(value, docs_dir, title if not section else f"{section} / {title}")
                continue
            with open(os.path.join(docs_dir, value), encoding="utf-8") as f:
                text = f.read()
            heading = re.search(r"^# (.+)$", text, re.M)
            out.append((section, title or (heading.group(1) if heading else value), value, first_sentence(text)))
    return out


def page_url(page: str) -> str:
    """The page's address relative to the site's root, as mkdocs' directory URLs make it."""
    if os.path.basename(page) == "index.md":
        return os.path.dirname(page) + "/" if os.path.dirname(page) else "./"
    return page.removesuffix(".md") + "/"


def on_post_build(config):
    sections: dict[str, list[str]] = {}  # in the navigation's order, a section's pages together
    for section, title, page, description in entries(config["nav"], config["docs_dir"]):
        line = f"- [{title}]({page_url(page)})" + (f": {description}" if description else "")
        sections.setdefault(section or "Home", []).append(line)
    lines = [f"# {config['site_name']}", "", f"> {config['site_description']}"]
    for section, pages in sections.items():
        lines += ["", f"## {section}", "", *pages]
    with open(os.path.join(config["site_dir"], "llms.txt"), "w", encoding="utf-8") as f:
        f.write("\n".join(lines) + "\n")
