"""Every setting documents itself: a description, a group and whether it is live."""

from __future__ import annotations

import argparse

from dpd_router.cli import build_parser
from dpd_router.config import SETTING_GROUPS, Settings, is_live, setting_group
from dpd_router.live import LIVE_SETTINGS
from dpd_router.settings_reference import cli_flags, render_markdown

# live.py's hand-written set before the settings carried their own `live` marker.
PREVIOUS_LIVE_SETTINGS = frozenset(
    {
        "routing_threshold",
        "threshold_mode",
        "interference_weight",
        "min_threshold",
        "max_threshold",
        "explore_share",
        "ttft_slo",
        "ttft_slo_max_tokens",
        "itl_slo",
        "itl_slo_share",
        "prefill_strategy",
        "session_header",
        "balance_abs_threshold",
        "balance_rel_threshold",
        "prefill_busy_queue_depth",
        "prefill_busy_max_tokens",
        "prefill_busy_queue_tokens",
        "prefill_retries",
        "prefill_failure_policy",
        "decode_retries",
        "hop_deadline_factor",
        "hop_deadline_floor",
        "hop_deadline_samples",
        "connect_timeout",
        "prefill_timeout",
        "first_token_timeout",
        "idle_timeout",
        "request_timeout",
        "max_in_flight",
        "max_queued",
        "queue_timeout",
        "max_body_bytes",
        "shadow",
        "log_level",
    }
)


# Live settings added since, each marked on its field.
LIVE_SETTINGS_SINCE = frozenset(
    {
        "experiments",
        "hang_probe_timeout",
        "models",
        "model_aliases",
        "stream_continuations",
        "stream_continuation_max_tokens",
    }
)


def test_live_settings_are_derived_from_the_field_markers() -> None:
    assert LIVE_SETTINGS == PREVIOUS_LIVE_SETTINGS | LIVE_SETTINGS_SINCE
    assert {name for name in Settings.model_fields if is_live(name)} == PREVIOUS_LIVE_SETTINGS | LIVE_SETTINGS_SINCE


def test_every_setting_has_a_description_and_a_known_group() -> None:
    for name, field in Settings.model_fields.items():
        assert field.description and field.description.strip(), f"{name} has no description"
        assert setting_group(name) in SETTING_GROUPS, f"{name}: unknown group {setting_group(name)!r}"
        extra = field.json_schema_extra
        assert isinstance(extra, dict) and isinstance(extra.get("live"), bool), f"{name} has no live marker"


def test_every_group_has_a_setting() -> None:
    used = {setting_group(name) for name in Settings.model_fields}
    assert used == set(SETTING_GROUPS)


def test_the_reference_lists_every_setting_with_its_flag() -> None:
    text = render_markdown()
    for name in Settings.model_fields:
        assert f"### `{name}`" in text
        assert f"`DPD_{name.upper()}`" in text
    flags = cli_flags()
    assert flags["routing_threshold"] == "--routing-threshold"
    assert flags["decode_urls"] == "--decode URL"
    serve = next(
        action.choices["serve"] for action in build_parser()._actions if isinstance(action, argparse._SubParsersAction)
    )
    known = {option for action in serve._actions for option in action.option_strings}
    assert {flag.split()[0] for flag in flags.values()} <= known
