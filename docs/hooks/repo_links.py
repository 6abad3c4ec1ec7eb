"""MkDocs hook: links from a page to the repository's own files (`../bench/RESULTS.md`).

They work where the pages are read in the tree (GitHub, an editor), but MkDocs only knows the pages
under docs/ and warns on every one of them, which `--strict` turns into a failure. This hook checks
each such link against the repository: a file that exists is shown as its path (or linked under
`repo_url` when mkdocs.yml sets one); one that does not is left alone, so MkDocs still warns and a
strict build fails on it.
"""

from __future__ import annotations

import posixpath
import re
from pathlib import Path

from mkdocs.config.defaults import MkDocsConfig
from mkdocs.structure.files import Files
from mkdocs.structure.pages import Page

REPOSITORY = Path(__file__).resolve().parents[2]
FENCE = re.compile(r"^\s*```")
CODE_SPAN = re.compile(r"(`+)(?:.+?)\1")
LINK = re.compile(r"\[(?P<text>[^\]]+)\]\((?P<target>[^)\s#]+)(?P<anchor>#[^)\s]*)?\)")


def repository_file(page: Page, target: str) -> str | None:
    """The repository path a page's relative link lands on, when it leaves docs/ and the file exists."""
    if "://" in target or target.startswith(("/", "mailto:")):
        return None
    joined = posixpath.normpath(posixpath.join(posixpath.dirname(page.file.src_uri), target))
    if not joined.startswith("../"):
        return None  # a page of the site: MkDocs checks it
    path = joined.removeprefix("../")
    return path if (REPOSITORY / path).exists() and not path.startswith("../") else None


def rewrite_line(line: str, page: Page, repo_url: str | None) -> str:
    def rewrite(match: re.Match[str]) -> str:
        path = repository_file(page, match["target"])
        if path is None:
            return match[0]
        if repo_url:
            return f"[{match['text']}]({repo_url.rstrip('/')}/blob/main/{path}{match['anchor'] or ''})"
        text = match["text"].strip("`")
        return f"`{path}`" if text == path else f"{match['text']} (`{path}`)"

    pieces = []  # rewrite outside code spans only
    position = 0
    for span in CODE_SPAN.finditer(line):
        pieces.append(LINK.sub(rewrite, line[position : span.start()]))
        pieces.append(span[0])
        position = span.end()
    pieces.append(LINK.sub(rewrite, line[position:]))
    return "".join(pieces)


def on_page_markdown(markdown: str, page: Page, config: MkDocsConfig, files: Files) -> str:
    lines, fenced = [], False
    for line in markdown.split("\n"):
        if FENCE.match(line):
            fenced = not fenced
        lines.append(line if fenced else rewrite_line(line, page, config.repo_url))
    return "\n".join(lines)
