"""The documentation site: `mkdocs build --strict` passes on docs/, and fails on a link that leads
nowhere (to a page, a heading of a page, or a file of the repository), so a broken link fails CI."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
DOCS = REPO / "docs"


def mkdocs_build(config: Path, site: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file", str(config), "--site-dir", str(site)],
        capture_output=True,
        text=True,
        cwd=config.parent,
    )


def nav_pages(config: dict) -> list[str]:
    return [page for entry in config["nav"] for page in entry.values()]


@pytest.fixture
def docs_copy(tmp_path: Path) -> tuple[Path, Path]:
    """The docs in a folder of their own, built with the repository's hook, so a test may break a page."""
    docs = tmp_path / "docs"
    shutil.copytree(DOCS, docs, ignore=shutil.ignore_patterns("hooks"))
    config = yaml.safe_load((REPO / "mkdocs.yml").read_text())
    config["docs_dir"] = str(docs)
    config["hooks"] = [str(REPO / hook) for hook in config["hooks"]]
    config_file = tmp_path / "mkdocs.yml"
    config_file.write_text(yaml.safe_dump(config, sort_keys=False))
    return docs, config_file


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    site = tmp_path_factory.mktemp("docs") / "site"
    result = mkdocs_build(REPO / "mkdocs.yml", site)
    assert result.returncode == 0, result.stderr
    return site


def test_the_docs_build_strictly_with_every_page_in_the_nav(site):
    pages = nav_pages(yaml.safe_load((REPO / "mkdocs.yml").read_text()))
    on_disk = sorted(str(p.relative_to(DOCS)) for p in DOCS.glob("*.md"))
    assert sorted(pages) == on_disk, "every page is in the nav, every nav entry is a page"
    for page in pages:
        built = "index.html" if page == "index.md" else f"{page.removesuffix('.md')}/index.html"
        assert (site / built).is_file(), built


def test_a_file_of_the_repository_shows_as_its_path_on_the_site(site):
    recovery = (site / "recovery" / "index.html").read_text()
    assert "<code>bench/RESULTS.md</code>" in recovery
    assert "../bench/RESULTS.md" not in recovery


BROKEN_LINKS = {
    "no-such-page.md": "[the cluster](no-such-page.md)",  # a page that does not exist
    "#no-such-heading": "[the cluster](local-cluster.md#no-such-heading)",  # a heading that does not exist
    "../bench/NO-SUCH-RESULTS.md": "[the figures](../bench/NO-SUCH-RESULTS.md)",  # a repository file that does not
}


def test_each_broken_link_fails_the_strict_build_and_is_named(docs_copy, tmp_path):
    docs, config = docs_copy
    assert mkdocs_build(config, tmp_path / "site").returncode == 0, "the copy builds before it is broken"
    page = docs / "diagnosis.md"
    page.write_text(page.read_text() + "".join(f"\nSee {link}.\n" for link in BROKEN_LINKS.values()))
    result = mkdocs_build(config, tmp_path / "site")
    assert result.returncode != 0
    warnings = [line for line in result.stderr.splitlines() if line.startswith("WARNING")]
    for target in BROKEN_LINKS:
        assert any("diagnosis.md" in w and target in w for w in warnings), (target, result.stderr)


def test_the_readme_links_lead_to_files_that_exist():
    """The README is read on GitHub, outside the site: its links into docs/ are checked here."""
    readme = (REPO / "README.md").read_text()
    targets = {t.split("#")[0] for t in re.findall(r"\]\(([^)\s]+)\)", readme) if "://" not in t}
    assert any(t.startswith("docs/") for t in targets)
    missing = sorted(t for t in targets if t and not (REPO / t).exists())
    assert not missing, f"README links to files that do not exist: {missing}"
