"""What advise reports: the evidence and the recommendations, and the options it was computed with."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from dpd_router.advise.bootstrap import Estimate

PATHS = ("direct", "disaggregated")
DEFAULT_CANDIDATES = (512, 1024, 2048, 4096, 8192, 16384, 32768)
DEFAULT_MIN_REQUESTS = 20
DEFAULT_TOLERANCE = 0.05
# One prefill engine's prompt tokens/s and one decode engine's output tokens/s: Llama-3.1-8B on an H100.
DEFAULT_PREFILL_RATE = 12000.0
DEFAULT_DECODE_RATE = 3000.0
STATISTICS = ("mean", "p50", "p90")
# The playbook's line between short and long prompts (tokens), and the share of traffic above it from
# which disaggregation is worth its cost.
LONG_PROMPT_TOKENS = 2048
LONG_PROMPT_SHARE = 0.15
# An inter-token gap above this is an ITL SLO miss (a bucket bound of the ITL histograms, so counts are exact).
DEFAULT_ITL_SLO = 0.1
DEFAULT_CLASSES = (LONG_PROMPT_TOKENS,)
DEFAULT_RESAMPLES = 1000
DEFAULT_CONFIDENCE = 0.95


@dataclass
class PathStats:
    requests: int
    mean: float | None
    p50: float | None
    p90: float | None
    p90_capped: bool = False

    def statistic(self, name: str) -> float | None:
        return {"mean": self.mean, "p50": self.p50, "p90": self.p90}[name]


@dataclass
class LengthBucket:
    """One prompt-length bucket of the TTFT-by-prompt-length histogram, both paths side by side."""

    label: str  # the metric's prompt_tokens label: the bucket's upper bound, or +Inf
    lower: int  # prompts of more than `lower` tokens ...
    upper: int | None  # ... and at most `upper` (None: no upper bound)
    direct: PathStats
    disaggregated: PathStats
    comparable: bool
    faster: str | None  # "direct", "disaggregated" (not losing, within the tolerance) or None
    note: str

    @property
    def span(self) -> str:
        if self.upper is None:
            return f">{self.lower}"
        return f"{self.lower + 1}-{self.upper}" if self.lower else f"1-{self.upper}"


@dataclass
class Recommendation:
    threshold: int | None
    current: int | None
    verdict: str  # crossover | disaggregate_more | keep_direct | not_enough_evidence
    basis: str  # measured | extrapolated | none
    action: str  # lower | raise | keep | none
    summary: str
    rule: str
    evidence: list[str] = field(default_factory=list)
    crossover_bucket: str | None = None
    estimated_crossover_tokens: float | None = None


@dataclass
class PoolLoad:
    engines: int
    waiting_per_engine: float | None
    running_per_engine: float | None
    kv_cache_usage: float | None
    router_in_flight_per_engine: float | None


@dataclass
class RatioAdvice:
    prefill_rate: float
    decode_rate: float
    prefill_prompt_tokens: float
    direct_prompt_tokens: float
    output_tokens: float
    prefill_work: float  # engine-seconds
    decode_work: float
    ratio: float | None  # prefill work / decode work
    recommended: str | None  # "p:d"
    split: dict[str, int] | None  # over the engines the router has now
    current: str | None
    at_recommended_threshold: dict[str, Any] | None
    load: dict[str, PoolLoad]
    load_check: str
    heuristic: str


@dataclass
class ArmClassStats:
    """One arm's requests of one prompt-length class on one path ("all": the arm's paths together)."""

    arm: str
    path: str
    request_class: str  # the class's span, e.g. "1-2048", ">2048"
    requests: float
    metrics: dict[str, Estimate]  # "ttft_p50", "ttft_p95", "itl_p99", "e2e_p95"


@dataclass
class Comparison:
    """The arms compared on one metric in one class: the best against the runner-up."""

    request_class: str
    metric: str
    status: str  # winner | undecided | not_enough_data
    best: str
    runner_up: str
    best_value: float | None
    runner_up_value: float | None
    difference: float | None  # runner-up minus best (seconds)
    difference_low: float | None  # its bootstrap interval
    difference_high: float | None
    winner: str | None
    # Traffic still needed for the difference to be significant (or the counts enough): as hours when the
    # scrape's duration is known, and as a multiple of the traffic in the scrape always (None: no estimate).
    more_hours: float | None
    traffic_factor: float | None
    note: str


@dataclass
class ArmsReport:
    """The arms side by side: per arm, path and prompt-length class, and the winner per class and metric."""

    arms: list[str]  # every arm seen, shadow included
    classes: list[str]
    observed_hours: float | None
    hours_basis: str
    stats: list[ArmClassStats]
    comparisons: list[Comparison]
    confidence: float
    resamples: int


@dataclass
class PromotionCheck:
    """The playbook's promotion rule in one long-prompt class: disaggregated P95 TTFT <= monolithic P95 TTFT
    + the measured transfer overhead."""

    request_class: str
    status: str  # pass | fail | not_enough_data | no_data
    disaggregated: Estimate
    disaggregated_source: str
    monolithic: Estimate
    monolithic_source: str
    margin: float | None  # disaggregated - (monolithic + overhead): <= 0 passes
    margin_low: float | None
    margin_high: float | None
    significant: bool  # the margin's interval lies on one side of 0
    note: str


@dataclass
class Promotion:
    status: str  # pass | fail | not_enough_data | no_data
    transfer_overhead: float | None
    transfer_overhead_basis: str
    classes: list[PromotionCheck]
    summary: str


@dataclass
class Verdict:
    """Whether DPD is the right tool: long prompts are common enough AND they cause the ITL SLO misses."""

    decision: str  # go | no_go | undecided
    long_prompt_share: float | None
    long_prompt_share_needed: float
    long_prompts_common: bool | None
    itl_slo: float
    itl_p99: Estimate
    itl_miss_share: float | None
    attribution: str  # attributed | not_attributed | no_misses | undecided | cannot_attribute
    attribution_evidence: list[str]
    itl_misses_from_long_prompts: bool | None
    summary: str
    reasons: list[str]


@dataclass
class Report:
    sources: list[str]
    requests: dict[str, float]
    thresholds: list[int]
    prompt_tokens: dict[str, Any]
    shares: list[dict[str, Any]]
    ttft: list[LengthBucket]
    ttft_by_path: dict[str, PathStats]
    phases: dict[str, dict[str, float | None]]
    decisions: list[dict[str, Any]]
    recommendation: Recommendation
    ratio: RatioAdvice
    warnings: list[str]
    settings: dict[str, Any]
    # threshold_mode adaptive: each router's effective threshold per decoder at its load when scraped, and
    # the costs it learned (empty for static routers)
    adaptive: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    # the arms compared (A/B experiment arms, the shadow), the promotion check and the go/no-go verdict
    arms: ArmsReport | None = None
    promotion: Promotion | None = None
    verdict: Verdict | None = None

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        for row, bucket in zip(data["ttft"], self.ttft, strict=True):
            row["span"] = bucket.span
        safe: dict[str, Any] = _json_safe(data)
        return safe


def _json_safe(value: Any) -> Any:
    if isinstance(value, float):
        if math.isnan(value):
            return None
        if math.isinf(value):
            return "+Inf" if value > 0 else "-Inf"
        return value
    if isinstance(value, dict):
        return {str(k): _json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_json_safe(v) for v in value]
    return value


@dataclass
class Options:
    min_requests: int = DEFAULT_MIN_REQUESTS
    tolerance: float = DEFAULT_TOLERANCE
    statistic: str = "mean"
    candidates: Sequence[int] = DEFAULT_CANDIDATES
    prefill_rate: float = DEFAULT_PREFILL_RATE
    decode_rate: float = DEFAULT_DECODE_RATE
    itl_slo: float = DEFAULT_ITL_SLO
    classes: Sequence[int] = DEFAULT_CLASSES  # upper bounds of the prompt-length classes (bucket bounds)
    resamples: int = DEFAULT_RESAMPLES
    confidence: float = DEFAULT_CONFIDENCE
    seed: int = 0
    observed_hours: float | None = None  # how long the scrape's traffic took, when known
    hours_basis: str = "unknown"
