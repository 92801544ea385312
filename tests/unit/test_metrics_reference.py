"""The metric reference (docs/metrics.md) covers every family, and every HELP text is one short line."""

from __future__ import annotations

from dpd_router.metrics import RouterMetrics
from dpd_router.metrics_reference import DETAILS, HELP_MAX_CHARS, families, render_markdown


def test_every_help_text_is_one_short_line() -> None:
    for family in RouterMetrics().registry.collect():
        assert "\n" not in family.documentation, family.name
        assert len(family.documentation) <= HELP_MAX_CHARS, (family.name, len(family.documentation))


def test_the_reference_lists_every_family_and_explains_only_real_ones() -> None:
    listed = families()
    text = render_markdown()
    names = {exposed.removesuffix("_total") for exposed, *_ in listed}
    assert set(DETAILS) <= names, set(DETAILS) - names
    for exposed, kind, labels, _ in listed:
        row = next(line for line in text.splitlines() if line.startswith(f"| `{exposed}` |"))
        assert f"| {kind} |" in row and all(f"`{label}`" in row for label in labels)
    assert len(listed) == len(list(RouterMetrics().registry.collect())) > 40
