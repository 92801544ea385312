"""A/B experiment arms: shares of the shared pool's traffic routed with other routing settings.

A request's arm is a pure function of its sticky key (a session key, an API key) and the configured
arms: a stable hash of the key, read as a point in [0, 1), falls in one arm's slice of the arms'
cumulative shares, in their configured order, or past them in arm `live`. So every worker and replica
puts a client in the same arm with no state shared between them, and a client stays there as long as
the arms before its own keep their shares.

Each arm plans with a `Planner.variant` of the shared pool's planner: the same engines, prefix index
and KV sources, its own threshold, mode and strategy, and its own adaptive model, which learns from
its own requests only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from dpd_router.config import ARM_OVERRIDES, Settings
from dpd_router.record.observe import DEFAULT_ARM
from dpd_router.record.outcome import Outcome
from dpd_router.routing.adaptive import AdaptiveModel
from dpd_router.routing.planner import Planner, adaptive_policy
from dpd_router.routing.rendezvous import rendezvous_weight
from dpd_router.routing.request import MAX_SESSION_KEY_CHARS

# The node name the arms' hash scores keys under, so an arm's clients are spread over the prefillers
# (the `session` strategy scores the same keys under the prefillers' URLs) as everyone else's are.
_ARM_NODE = "dpd-router-arm"
_SCALE = float(1 << 64)


def arm_position(key: str) -> float:
    """Where `key` falls in [0, 1): the same in every process and on every machine (unlike `hash()`)."""
    return rendezvous_weight(key[:MAX_SESSION_KEY_CHARS], _ARM_NODE) / _SCALE


@dataclass(frozen=True)
class Arm:
    """An arm in force: its name, where its slice of [0, 1) ends, and the planner its requests take."""

    name: str
    share: float
    upper: float
    planner: Planner
    # The routing settings it plans with, overridden or not (ARM_OVERRIDES' values in its settings).
    routing: dict[str, Any]


class ExperimentArms:
    """The arms in force over the shared pool's planner (`base`, whose requests are arm `live`).

    Live: `reconfigure` builds the arms anew from the settings, keeping what each arm's adaptive model
    learned while its name stays.
    """

    def __init__(self, settings: Settings, base: Planner, adaptive: AdaptiveModel) -> None:
        self._base = base
        # Arm `live`'s model (the shared pool's planner's, which tenants' planners share too).
        self._adaptive = adaptive
        self._arms: tuple[Arm, ...] = ()
        self._learners: dict[str, AdaptiveModel] = {}
        self.sticky_by: Literal["session", "api_key"] = "session"
        self.reconfigure(settings)

    @property
    def active(self) -> bool:
        """Whether any arm is configured (none: every request is arm `live`, and nothing is hashed)."""
        return bool(self._arms)

    @property
    def arms(self) -> tuple[Arm, ...]:
        return self._arms

    @property
    def base(self) -> Planner:
        """The shared pool's planner: arm `live`'s."""
        return self._base

    def reconfigure(self, settings: Settings) -> None:
        experiments = settings.experiments
        configured = experiments.arms if experiments is not None else []
        arms: list[Arm] = []
        learners: dict[str, AdaptiveModel] = {}
        upper = 0.0
        for config in configured:
            arm_settings = settings.model_copy(update=config.overrides())
            learner = self._learners.get(config.name)
            if learner is None:
                learner = AdaptiveModel(adaptive_policy(arm_settings), arm_settings.routing_threshold)
            else:
                learner.policy = adaptive_policy(arm_settings)
                learner.reprior(arm_settings.routing_threshold)
            learners[config.name] = learner
            upper += config.share
            planner = self._base.variant(arm_settings, learner)
            routing = {name: getattr(arm_settings, name) for name in ARM_OVERRIDES}
            arms.append(Arm(config.name, config.share, upper, planner, routing))
        # Swapped whole: a request being planned sees the old arms or the new ones, never a mix.
        self._arms, self._learners = tuple(arms), learners
        self.sticky_by = experiments.sticky_by if experiments is not None else "session"

    def assign(self, *, session_key: str | None, api_key: str | None, request_id: str) -> Arm | None:
        """The arm the request's sticky key falls in; None for arm `live`. `session_key` is read only
        with `sticky_by: session`; a request without the key hashes the next one (the API key, then its
        own id, which spreads such requests over the arms without keeping them anywhere)."""
        key = (session_key if self.sticky_by == "session" else None) or api_key or request_id
        return self.arm_at(arm_position(key))

    def arm_at(self, position: float) -> Arm | None:
        for arm in self._arms:
            if position < arm.upper:
                return arm
        return None

    def learn_from(self, outcome: Outcome) -> None:
        """Each arm's adaptive model learns from its own arm's requests only; arm `live`'s from those no
        arm took. Requests of an arm no longer configured (or shadow copies) teach no one."""
        if outcome.arm == DEFAULT_ARM:
            self._adaptive.learn_from(outcome)
            return
        learner = self._learners.get(outcome.arm)
        if learner is not None:
            learner.learn_from(outcome)

    def describe(self) -> list[dict[str, Any]]:
        """The arms in force, with the routing settings each plans with (for the admin routing view)."""
        return [{"name": arm.name, "share": arm.share, **arm.routing} for arm in self._arms]
