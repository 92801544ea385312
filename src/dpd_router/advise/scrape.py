"""The dpd_router_* samples of `/metrics` scrapes: parsed, summed over routers, differenced over time."""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from prometheus_client.parser import text_string_to_metric_families

from dpd_router.advise.histogram import Histogram, parse_bound
from dpd_router.record.metrics import PREFIX, UNKNOWN_LENGTH

# The adaptive model's learned costs: its `model` label names a cost model (handoff, interference), not a served one.
ADAPTIVE_COST = f"{PREFIX}_adaptive_cost"
# The families by prompt length of routers before each latency became one family with a `prompt_tokens` label.
LEGACY_BY_PROMPT_LENGTH = {
    "time_to_first_token_seconds": "ttft_by_prompt_length_seconds",
    "inter_token_latency_seconds": "itl_by_prompt_length_seconds",
    "e2e_latency_seconds": "e2e_by_prompt_length_seconds",
}


class AdviseError(Exception):
    """The scrapes could not be read or combined; the message says why."""


LabelItems = tuple[tuple[str, str], ...]
SampleKey = tuple[str, LabelItems]

# The request metrics' `arm` label: "live" for traffic no experiment arm takes (and in scrapes of routers
# older than the label, which have none), an experiment arm's name, or "shadow" for the copies sent to a
# shadow endpoint (path "monolithic" or "dpd").
ARM_LABEL = "arm"
LIVE_ARM = "live"
SHADOW_ARM = "shadow"


def arm_of(value: str) -> str:
    """An `arm` label value as grouped by `counters`/`histograms` ("" when absent): absent is "live"."""
    return value or LIVE_ARM


@dataclass
class Scrape:
    """The dpd_router_* samples of one or more scrapes: cumulative ones (counters, histograms) and gauges
    (one value per router scraped, since summing them is right for some and wrong for others)."""

    cumulative: dict[SampleKey, float] = field(default_factory=dict)
    gauges: dict[SampleKey, list[float]] = field(default_factory=dict)

    @classmethod
    def parse(cls, text: str) -> Scrape:
        scrape = cls()
        try:
            families = list(text_string_to_metric_families(text))
        except Exception as exc:  # the parser raises ValueError and friends on bad text
            raise AdviseError(f"not Prometheus text exposition: {exc}") from None
        for family in families:
            if not family.name.startswith(PREFIX):
                continue
            for sample in family.samples:
                if sample.name.endswith("_created"):
                    continue
                key = (sample.name, tuple(sorted(sample.labels.items())))
                if family.type in ("counter", "histogram", "summary"):
                    scrape.cumulative[key] = float(sample.value)
                else:
                    scrape.gauges[key] = [float(sample.value)]
        return scrape

    @property
    def empty(self) -> bool:
        return not self.cumulative and not self.gauges

    def plus(self, other: Scrape) -> Scrape:
        """Several routers' scrapes together: cumulative series add up, gauges keep every router's value."""
        out = Scrape(dict(self.cumulative), {k: list(v) for k, v in self.gauges.items()})
        for key, value in other.cumulative.items():
            out.cumulative[key] = out.cumulative.get(key, 0.0) + value
        for key, values in other.gauges.items():
            out.gauges.setdefault(key, []).extend(values)
        return out

    def minus(self, earlier: Scrape) -> Scrape:
        """The traffic between `earlier` and this scrape of the same router(s); gauges are this scrape's."""
        out = Scrape({}, {k: list(v) for k, v in self.gauges.items()})
        for key, value in self.cumulative.items():
            before = earlier.cumulative.get(key, 0.0)
            if value < before - 1e-6:
                raise AdviseError(
                    f"{key[0]}{dict(key[1])} went down between the scrapes ({before:g} -> {value:g}): the router "
                    "restarted in between, or the scrapes are in the wrong order (--since takes the earlier one)"
                )
            out.cumulative[key] = value - before
        missing = [key for key in earlier.cumulative if key not in self.cumulative and earlier.cumulative[key] > 0]
        if missing:
            name, labels = missing[0]
            raise AdviseError(f"{name}{dict(labels)} is in the earlier scrape but not in the later one")
        return out

    def arms_only(self, keep: Callable[[str], bool]) -> Scrape:
        """The cumulative series of the arms `keep` accepts (a series without the label is arm "live");
        gauges, which have no arm, are kept."""
        out = Scrape({}, {k: list(v) for k, v in self.gauges.items()})
        for key, value in self.cumulative.items():
            if keep(arm_of(dict(key[1]).get(ARM_LABEL, ""))):
                out.cumulative[key] = value
        return out

    def models(self) -> list[str]:
        """The served models the request series are labelled with (none in a router's scrape before the label)."""
        return sorted(
            {
                labels["model"]
                for name, labels in ((sample, dict(labels)) for sample, labels in [*self.cumulative, *self.gauges])
                if "model" in labels and not name.startswith(ADAPTIVE_COST)
            }
        )

    def models_as_arms(self, models: Sequence[str]) -> Scrape:
        """The series of `models` with each model in the `arm` label (`MODEL ARM` for an experiment arm's), so
        the arms report compares the models (the versions behind a model alias) as it compares arms; the
        other models' series are left out, those no model labels kept."""
        wanted = set(models)
        out = Scrape({}, {k: list(v) for k, v in self.gauges.items()})
        for (name, labels), value in self.cumulative.items():
            found = dict(labels)
            model = found.get("model")
            if model is None or name.startswith(ADAPTIVE_COST):
                out.cumulative[(name, labels)] = value
                continue
            if model not in wanted:
                continue
            arm = arm_of(found.get(ARM_LABEL, ""))
            if arm != SHADOW_ARM:  # the shadow's copies stay the shadow's, shown beside the models
                found[ARM_LABEL] = model if arm == LIVE_ARM else f"{model} {arm}"
            key = (name, tuple(sorted(found.items())))
            out.cumulative[key] = out.cumulative.get(key, 0.0) + value
        return out

    def model_only(self, model: str) -> Scrape:
        """The series of one served model, and those no model labels (the engines', the listener's): the
        engines' series are every model's, so what the ratio advice reads of them is too."""

        def keep(key: SampleKey) -> bool:
            name, labels = key
            found = dict(labels)
            return "model" not in found or name.startswith(ADAPTIVE_COST) or found["model"] == model

        return Scrape(
            {k: v for k, v in self.cumulative.items() if keep(k)},
            {k: list(v) for k, v in self.gauges.items() if keep(k)},
        )

    def counters(self, name: str, by: Sequence[str]) -> dict[tuple[str, ...], float]:
        """A counter's values summed by the labels `by`."""
        totals: dict[tuple[str, ...], float] = defaultdict(float)
        for (sample, labels), value in self.cumulative.items():
            if sample == name:
                found = dict(labels)
                totals[tuple(found.get(label, "") for label in by)] += value
        return dict(totals)

    def gauge_values(self, name: str) -> list[tuple[dict[str, str], float]]:
        return [
            (dict(labels), value)
            for (sample, labels), values in self.gauges.items()
            if sample == name
            for value in values
        ]

    def histograms(self, name: str, by: Sequence[str] = ()) -> dict[tuple[str, ...], Histogram]:
        """A histogram's series summed by the labels `by` (every other label summed over)."""
        buckets: dict[tuple[str, ...], dict[float, float]] = defaultdict(lambda: defaultdict(float))
        sums: dict[tuple[str, ...], float] = defaultdict(float)
        for (sample, labels), value in self.cumulative.items():
            found = dict(labels)
            group = tuple(found.get(label, "") for label in by)
            if sample == f"{name}_bucket":
                buckets[group][parse_bound(found.get("le", "+Inf"))] += value
            elif sample == f"{name}_sum":
                sums[group] += value
        out = {}
        for group, by_bound in buckets.items():
            bounds = sorted(by_bound)
            out[group] = Histogram(bounds, [by_bound[b] for b in bounds], sums.get(group, 0.0))
        return out

    def by_prompt_length(self, name: str, by: Sequence[str]) -> dict[tuple[str, ...], Histogram]:
        """The latency family `name` (without the prefix) by `by`, whose last label is `prompt_tokens`, over the
        prompts of a known length; from a router that kept them in a family apart, that family
        (LEGACY_BY_PROMPT_LENGTH), so the scrapes of either read alike."""
        assert by and by[-1] == "prompt_tokens"
        found = {
            key: hist for key, hist in self.histograms(f"{PREFIX}_{name}", by).items() if key[-1] != UNKNOWN_LENGTH
        }
        legacy = LEGACY_BY_PROMPT_LENGTH.get(name)
        if found or legacy is None:
            return found
        return self.histograms(f"{PREFIX}_{legacy}", by)

    def histogram(self, name: str) -> Histogram:
        return self.histograms(name).get((), Histogram([math.inf], [0.0], 0.0))
