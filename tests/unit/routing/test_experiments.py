"""Experiment arms: validation, sticky hash assignment, each arm's planner, and learning per arm."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, get_args

import pytest

from dpd_router.config import ARM_OVERRIDES, ExperimentArm, Settings, SettingsError, load_settings, updated_settings
from dpd_router.pool.pool import Pool
from dpd_router.prompt.tokenizer import Prompt
from dpd_router.record.metrics import RouterMetrics
from dpd_router.record.outcome import Outcome
from dpd_router.routing.adaptive import AdaptiveModel
from dpd_router.routing.experiments import ExperimentArms, arm_position
from dpd_router.routing.planner import adaptive_policy, build_planner

P, D = "http://10.0.0.1:8100", "http://10.0.0.2:8200"
TWO_ARMS = {
    "arms": [
        {"name": "t8192", "share": 0.5, "routing_threshold": 8192},
        {"name": "adaptive", "share": 0.25, "threshold_mode": "adaptive", "itl_slo": 0.05},
    ]
}


def settings_with(experiments: dict[str, Any] | None = None, **extra: Any) -> Settings:
    return load_settings(prefill_urls=[P], decode_urls=[D], experiments=experiments, **extra)


def arms_for(settings: Settings) -> ExperimentArms:
    adaptive = AdaptiveModel(adaptive_policy(settings), settings.routing_threshold)
    base = build_planner(
        settings, Pool(settings.prefill_urls, settings.decode_urls), RouterMetrics(), adaptive=adaptive
    )
    return ExperimentArms(settings, base, adaptive)


def budgets(model: AdaptiveModel | None) -> dict[str, Any]:
    """The decoders whose ITL budget `model` has counted gaps for."""
    assert model is not None
    described = model.describe()["itl_budget"]
    assert isinstance(described, dict)
    return described


def arm_name(arms: ExperimentArms, key: str) -> str:
    arm = arms.assign(session_key=key, api_key=None, request_id="unused")
    return "live" if arm is None else arm.name


def prompt(tokens: int) -> Prompt:
    return Prompt(token_ids=list(range(tokens)), num_tokens=tokens, seconds=0.0)


def outcome(arm: str) -> Outcome:
    return Outcome(
        ok=True,
        path="direct",
        stream=True,
        uncached_tokens=100,
        prefiller=None,
        decoder=D,
        decoder_streams=0.0,
        decoder_queue=0.0,
        prefiller_queue=None,
        prefill_seconds=None,
        prefill_retried=False,
        prefill_overlaps_decode=False,
        first_token_seconds=0.05,
        token_gaps=9,
        arm=arm,
    )


# -- validation -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("experiments", "complaint"),
    [
        ({"arms": [{"name": "a", "share": 0.5}, {"name": "a", "share": 0.1}]}, "unique"),
        ({"arms": [{"name": "live", "share": 0.5}]}, "reserved"),
        ({"arms": [{"name": "shadow", "share": 0.5}]}, "reserved"),
        ({"arms": [{"name": "Big Arm", "share": 0.5}]}, "pattern"),
        ({"arms": [{"name": 'a"}', "share": 0.5}]}, "pattern"),
        ({"arms": [{"name": "a", "share": 0.6}, {"name": "b", "share": 0.5}]}, "add up to 1.1"),
        ({"arms": [{"name": "a", "share": 0}]}, "greater than 0"),
        ({"arms": [{"name": "a", "share": 1.5}]}, "less than or equal to 1"),
        ({"arms": [{"name": "a", "share": 0.5, "routing_threshold": 0}]}, "routing_threshold"),
        ({"arms": [{"name": "a", "share": 0.5, "threshold_mode": "smart"}]}, "threshold_mode"),
        ({"arms": [{"name": "a", "share": 0.5, "itl_slo_share": 0.5}]}, "itl_slo_share"),
        ({"arms": [{"name": "a", "share": 0.5, "block_size": 32}]}, "unknown setting"),
        ({"sticky_by": "cookie", "arms": []}, "sticky_by"),
    ],
)
def test_bad_experiments_are_refused_naming_the_setting(experiments: dict[str, Any], complaint: str) -> None:
    with pytest.raises(SettingsError, match="experiments") as refused:
        settings_with(experiments)
    assert complaint in str(refused.value)


def test_arm_overrides_carry_the_same_bounds_as_the_settings_they_override() -> None:
    # An arm's settings are a copy of the top level with its overrides, not validated again.
    for name in ARM_OVERRIDES:
        arm_field, setting = ExperimentArm.model_fields[name], Settings.model_fields[name]
        assert arm_field.metadata == setting.metadata, name
        optional = set(get_args(setting.annotation)) if type(None) in get_args(setting.annotation) else None
        assert set(get_args(arm_field.annotation)) == (optional or {setting.annotation, type(None)}), name


def test_shares_that_add_up_to_one_are_accepted() -> None:
    settings = settings_with({"arms": [{"name": n, "share": s} for n, s in (("a", 0.7), ("b", 0.2), ("c", 0.1))]})
    assert settings.experiments is not None and len(settings.experiments.arms) == 3


def test_experiments_come_from_yaml_and_from_json_in_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = tmp_path / "router.yaml"
    config.write_text(
        f"decode_urls: [{D}]\n"
        "experiments:\n"
        "  sticky_by: api_key\n"
        "  arms:\n"
        "    - {name: t8192, share: 0.5, routing_threshold: 8192}\n"
    )
    from_yaml = load_settings(config=str(config)).experiments
    assert from_yaml is not None and from_yaml.sticky_by == "api_key"
    assert [(arm.name, arm.share, arm.overrides()) for arm in from_yaml.arms] == [
        ("t8192", 0.5, {"routing_threshold": 8192})
    ]
    monkeypatch.setenv("DPD_DECODE_URLS", D)
    monkeypatch.setenv("DPD_EXPERIMENTS", json.dumps(TWO_ARMS))
    from_env = load_settings().experiments
    assert from_env is not None and [arm.name for arm in from_env.arms] == ["t8192", "adaptive"]
    assert from_env.arms[1].overrides() == {"threshold_mode": "adaptive", "itl_slo": 0.05}


# -- assignment -------------------------------------------------------------------------------------


def test_an_arm_position_is_the_same_in_another_process_with_another_hash_seed() -> None:
    keys = [f"session-{i}" for i in range(50)] + ["", "ünïcode", "x" * 1000]
    code = (
        "import json, sys\n"
        "from dpd_router.routing.experiments import arm_position\n"
        "print(json.dumps([arm_position(k) for k in json.loads(sys.stdin.read())]))\n"
    )
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    other = subprocess.run(
        [sys.executable, "-c", code], input=json.dumps(keys), capture_output=True, text=True, env=env, check=True
    )
    assert json.loads(other.stdout) == [arm_position(key) for key in keys]
    assert all(0.0 <= position < 1.0 for position in json.loads(other.stdout))


def test_two_routers_with_the_same_arms_put_every_key_in_the_same_arm() -> None:
    first, second = arms_for(settings_with(TWO_ARMS)), arms_for(settings_with(TWO_ARMS))
    keys = [f"user-{i}" for i in range(2000)]
    assert [arm_name(first, key) for key in keys] == [arm_name(second, key) for key in keys]
    assert [arm_name(first, key) for key in keys] == [arm_name(first, key) for key in keys]


def test_shares_are_respected_over_ten_thousand_keys() -> None:
    arms = arms_for(settings_with(TWO_ARMS))
    counts = {"t8192": 0, "adaptive": 0, "live": 0}
    for i in range(10_000):
        counts[arm_name(arms, f"conversation-{i}")] += 1
    # A good hash spreads keys like coin flips: a standard deviation of at most 0.005 here.
    assert abs(counts["t8192"] / 10_000 - 0.5) < 0.02, counts
    assert abs(counts["adaptive"] / 10_000 - 0.25) < 0.02, counts
    assert abs(counts["live"] / 10_000 - 0.25) < 0.02, counts


def test_the_session_key_wins_then_the_api_key_then_the_request_id() -> None:
    arms = arms_for(settings_with({"arms": [{"name": "half", "share": 0.5}]}))
    inside = next(f"k{i}" for i in range(100) if arm_position(f"k{i}") < 0.5)
    outside = next(f"k{i}" for i in range(100) if arm_position(f"k{i}") >= 0.5)

    def assigned(**keys: Any) -> str:
        arm = arms.assign(**{"session_key": None, "api_key": None, "request_id": outside, **keys})
        return "live" if arm is None else arm.name

    assert assigned(session_key=inside, api_key=outside) == "half"
    assert assigned(api_key=inside) == "half"
    assert assigned(request_id=inside) == "half"
    assert assigned() == "live"


def test_sticky_by_api_key_ignores_the_session_key() -> None:
    arms = arms_for(settings_with({"sticky_by": "api_key", "arms": [{"name": "half", "share": 0.5}]}))
    inside = next(f"k{i}" for i in range(100) if arm_position(f"k{i}") < 0.5)
    outside = next(f"k{i}" for i in range(100) if arm_position(f"k{i}") >= 0.5)
    assert arms.assign(session_key=inside, api_key=outside, request_id=inside) is None
    arm = arms.assign(session_key=outside, api_key=inside, request_id=outside)
    assert arm is not None and arm.name == "half"


def test_without_experiments_no_arm_is_active() -> None:
    arms = arms_for(settings_with(None))
    assert not arms.active
    assert arms.assign(session_key="any", api_key=None, request_id="r") is None
    assert not arms_for(settings_with({"arms": []})).active


# -- each arm's planner -----------------------------------------------------------------------------


def test_an_arm_plans_with_its_overrides_over_the_shared_pool_and_prefix_index() -> None:
    settings = settings_with(TWO_ARMS, routing_threshold=2048, threshold_mode="static")
    arms = arms_for(settings)
    base = arms.base
    t8192, adaptive = arms.arms
    assert base.plan(prompt(3000)).path == "disaggregated"
    assert t8192.planner.plan(prompt(3000)).path == "direct"
    assert t8192.planner.plan(prompt(3000)).reason == "below_threshold"
    assert t8192.planner.pool is base.pool and t8192.planner.cache is base.cache
    assert adaptive.planner.threshold_mode == "adaptive" and adaptive.planner.threshold == 2048
    assert adaptive.planner.adaptive is not None and adaptive.planner.adaptive is not base.adaptive
    assert adaptive.planner.adaptive.policy.itl_slo == 0.05
    assert arms.describe()[0] == {
        "name": "t8192",
        "share": 0.5,
        "routing_threshold": 8192,
        "threshold_mode": "static",
        "prefill_strategy": "prefixaware",
        "ttft_slo": None,
        "ttft_slo_max_tokens": 0,
        "itl_slo": None,
        "itl_slo_share": 0.0,
    }


def test_a_live_change_moves_shares_and_settings_and_keeps_what_an_arm_learned() -> None:
    settings = settings_with(TWO_ARMS)
    arms = arms_for(settings)
    learner = arms.arms[1].planner.adaptive
    keys = [f"user-{i}" for i in range(4000)]
    before = [arm_name(arms, key) for key in keys]
    changed = {
        "arms": [
            {"name": "t8192", "share": 0.1, "routing_threshold": 16384},
            {"name": "adaptive", "share": 0.25, "threshold_mode": "adaptive", "itl_slo": 0.2},
        ]
    }
    arms.reconfigure(updated_settings(settings, {"experiments": changed}))
    after = [arm_name(arms, key) for key in keys]
    assert 0.08 < after.count("t8192") / len(keys) < 0.12
    # Keys that stayed in the first arm's smaller slice are still in it.
    assert all(was == "t8192" for was, now in zip(before, after, strict=True) if now == "t8192")
    assert arms.arms[0].planner.threshold == 16384
    assert learner is not None and arms.arms[1].planner.adaptive is learner
    assert learner.policy.itl_slo == 0.2

    arms.reconfigure(updated_settings(settings, {"experiments": None}))
    assert not arms.active and all(arm_name(arms, key) == "live" for key in keys[:100])


def test_each_arm_learns_from_its_own_requests_only() -> None:
    arms = arms_for(settings_with(TWO_ARMS))
    live, own, other = arms.base.adaptive, arms.arms[1].planner.adaptive, arms.arms[0].planner.adaptive
    arms.learn_from(outcome("adaptive"))
    assert D in budgets(own)
    assert D not in budgets(live) and D not in budgets(other)
    arms.learn_from(outcome("shadow"))
    arms.learn_from(outcome("gone"))
    assert D not in budgets(live)
    arms.learn_from(outcome("live"))
    assert D in budgets(live)
