"""mkdocs hooks: the configuration reference generated from the Settings model, the metric reference from
RouterMetrics, and the pages kept beside the code (deploy/README.md, benchmarks/results/) published with
the site.

The reference is rendered from this checkout's sources (src/ first on the path), so the docs
describe the code they are built with.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from mkdocs.structure.files import File, Files, InclusionLevel
from mkdocs.structure.pages import Page

ROOT = Path(__file__).resolve().parents[2]
MARKER = "<!-- settings-reference -->"
METRICS_MARKER = "<!-- metrics-reference -->"
# Directories and files outside docs/ that the site publishes under the same relative paths.
PUBLISHED = ("deploy/README.md", "benchmarks/results")
SUFFIXES = {".md", ".png"}


def on_files(files: Files, config: Any) -> Files:
    for entry in PUBLISHED:
        path = ROOT / entry
        paths = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.suffix in SUFFIXES)
        for source in paths:
            uri = source.relative_to(ROOT).as_posix()
            inclusion = InclusionLevel.INCLUDED if uri == "deploy/README.md" else InclusionLevel.NOT_IN_NAV
            files.append(File(uri, str(ROOT), config["site_dir"], config["use_directory_urls"], inclusion=inclusion))
    return files


def on_page_markdown(markdown: str, page: Page, config: Any, files: Files) -> str:
    if MARKER not in markdown and METRICS_MARKER not in markdown:
        return markdown
    sys.path.insert(0, str(ROOT / "src"))
    try:
        from dpd_router.record import metrics_reference
        from dpd_router.settings_reference import render_markdown
    finally:
        sys.path.remove(str(ROOT / "src"))
    markdown = markdown.replace(MARKER, render_markdown(heading_level=2))
    return markdown.replace(METRICS_MARKER, metrics_reference.render_markdown())
