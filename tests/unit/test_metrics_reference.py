"""The metric reference (docs/metrics.md) covers every family, and every HELP text is one short line."""

from __future__ import annotations

from dpd_router.record.metrics import RouterMetrics
from dpd_router.record.metrics_reference import DETAILS, HELP_MAX_CHARS, families, render_markdown


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


def test_a_quantity_has_one_family_and_its_cuts_are_labels() -> None:
    names = {family.name for family in RouterMetrics().registry.collect()}
    assert not [name for name in names if "_by_" in name], "a cut of a quantity is a label, not a family"
    # The families merged into others' labels: TTFT, ITL and E2E by prompt length (`prompt_tokens`), ITL
    # per request (time per output token), requests by API (`api`).
    retired = {"ttft_by_prompt_length", "itl_by_prompt_length", "time_per_output_token", "api_requests"}
    assert not {name for name in names if name.removeprefix("dpd_router_").removesuffix("_seconds") in retired}
    (requests,) = [labels for exposed, _, labels, _ in families() if exposed == "dpd_router_requests_total"]
    assert list(requests) == ["model", "arm", "api", "path", "outcome"]
