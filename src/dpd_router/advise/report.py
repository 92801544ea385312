"""What advise reports: the evidence and the recommendations, and the options it was computed with."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

PATHS = ("direct", "disaggregated")
DEFAULT_CANDIDATES = (512, 1024, 2048, 4096, 8192, 16384, 32768)
DEFAULT_MIN_REQUESTS = 20
DEFAULT_TOLERANCE = 0.05
# One prefill engine's prompt tokens/s and one decode engine's output tokens/s: Llama-3.1-8B on an H100.
DEFAULT_PREFILL_RATE = 12000.0
DEFAULT_DECODE_RATE = 3000.0
STATISTICS = ("mean", "p50", "p90")


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
