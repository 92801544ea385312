"""The playbook's two decisions, from the router's own metrics.

**Promotion check**, per long-prompt class (prompts over 2k tokens): promote disaggregation only when
its P95 TTFT is at most the monolithic P95 TTFT plus the measured transfer overhead.

- Disaggregated: the shadow's `dpd` path (a staging dpd-router) when it has traffic in the class,
  else the live arms' `disaggregated` path.
- Monolithic: the shadow's `monolithic` path (a plain engine endpoint) when it has traffic in the
  class, else the live arms' `direct` path (a decoder prefilling the prompt itself).
- Transfer overhead: the mean `first_token` phase of the live disaggregated requests (their decode
  call until its first token: the KV transfer and one decode step, what the adaptive model calls the
  handoff); else the adaptive model's learned handoff overhead; else 0, said so.

The margin (disaggregated - monolithic - overhead) gets a bootstrap interval; a class passes when the
margin is <= 0, and the check says whether the interval is clear of 0 (significant) or not yet.

**Go/no-go verdict**: DPD is the right tool when (1) more than 15% of the requests have prompts over
2k tokens (`dpd_router_prompt_tokens`, shadow copies left out) AND (2) the ITL SLO misses are
attributable to long prompts. (2) compares ITL tails where long prompts are prefilled on decoders
(arms whose long prompts mostly go direct; the shadow's monolithic endpoint) with where they are
disaggregated (arms whose long prompts mostly take the prefill hop; the shadow's staging dpd-router):
the misses are attributed to long prompts when the live ITL p99 is over the SLO and the decoder-
prefilled group's ITL p99 is over the SLO and significantly above the disaggregated group's. With
only one of the two groups in the data the misses cannot be attributed, and the verdict says so.
"""

from __future__ import annotations

from dpd_router.advise.arms import (
    TTFT_FAMILY,
    Breakdown,
    RequestClass,
    Select,
    request_classes,
    select_arm,
    select_path,
)
from dpd_router.advise.bootstrap import Bootstrap, Estimate, interval, needed_observations
from dpd_router.advise.histogram import Histogram, combined
from dpd_router.advise.render import seconds_text
from dpd_router.advise.report import (
    LONG_PROMPT_SHARE,
    LONG_PROMPT_TOKENS,
    Options,
    Promotion,
    PromotionCheck,
    Verdict,
)
from dpd_router.advise.scrape import SHADOW_ARM, Scrape, arm_of
from dpd_router.record.metrics import PREFIX, PROMPT_LENGTH_BOUNDS

P95 = 0.95
P99 = 0.99
# Arms whose shares of long prompts prefilled on the decoders differ by less than this route them alike.
DIRECT_SPREAD = 0.2
# ITL within its SLO shows there are no misses to fix only where at least this share of the long prompts
# is prefilled on the decoders (with all of them disaggregated, it may be disaggregation that keeps it there).
ON_DECODERS_ENOUGH = 0.2


def _live(path: str) -> Select:
    return lambda arm, p: arm != SHADOW_ARM and p == path


def _shadow(path: str) -> Select:
    return lambda arm, p: arm == SHADOW_ARM and p == path


def transfer_overhead(scrape: Scrape) -> tuple[float | None, str]:
    """The measured KV-transfer overhead of the prefill hop (seconds), and where it comes from."""
    phases = scrape.arms_only(lambda arm: arm != SHADOW_ARM).histograms(f"{PREFIX}_phase_seconds", ("path", "phase"))
    handoff = phases.get(("disaggregated", "first_token"))
    if handoff is not None and handoff.mean is not None:
        return handoff.mean, (
            f"mean first_token phase of {handoff.count:,.0f} disaggregated requests (decode call to first token: "
            "the KV transfer and one decode step)"
        )
    learned = [
        value
        for labels, value in scrape.gauge_values(f"{PREFIX}_adaptive_cost")
        if labels.get("model") == "handoff" and labels.get("term") == "overhead_seconds" and value == value
    ]
    if learned:
        return sum(learned) / len(learned), "the adaptive model's learned handoff overhead"
    return None, "not measured (no disaggregated requests): compared with 0"


def promotion_check(scrape: Scrape, opts: Options, boot: Bootstrap) -> Promotion:
    """The check per prompt-length bucket over 2k tokens: a class as wide as "over 2048" would compare the
    direct path's prompts (up to the threshold) with the disaggregated path's (longer ones)."""
    buckets = request_classes(PROMPT_LENGTH_BOUNDS)
    breakdown = Breakdown(scrape, buckets)
    overhead, basis = transfer_overhead(scrape)
    needed = needed_observations(P95, opts.min_requests)
    checks = []
    for index, bucket in enumerate(buckets):
        if not bucket.long:
            continue
        disaggregated, disaggregated_source = _source(
            breakdown, index, (_shadow("dpd"), "shadow dpd"), (_live("disaggregated"), "live disaggregated")
        )
        monolithic, monolithic_source = _source(
            breakdown, index, (_shadow("monolithic"), "shadow monolithic"), (_live("direct"), "live direct")
        )
        if disaggregated is None and monolithic is None:
            continue
        checks.append(
            _check(bucket, disaggregated, disaggregated_source, monolithic, monolithic_source, overhead or 0.0,
                   needed, boot)
        )  # fmt: skip
    statuses = {check.status for check in checks}
    status = next((s for s in ("fail", "pass", "not_enough_data") if s in statuses), "no_data")
    allowance = f"the transfer overhead {_ms(overhead)}" if overhead is not None else "no transfer overhead"
    judged = ", ".join(c.request_class for c in checks if c.status in ("pass", "fail"))
    summary = {
        "pass": f"Promote: the disaggregated P95 TTFT is within the monolithic P95 TTFT plus {allowance} in every "
        f"prompt-length bucket over {LONG_PROMPT_TOKENS} tokens with enough data on both sides ({judged}).",
        "fail": "Do not promote: in "
        + ", ".join(c.request_class for c in checks if c.status == "fail")
        + f" tokens the disaggregated P95 TTFT exceeds the monolithic P95 TTFT plus {allowance}.",
        "not_enough_data": f"Not enough data yet: each side needs {needed} requests in a prompt-length bucket over "
        f"{LONG_PROMPT_TOKENS} tokens for its P95 to count.",
        "no_data": f"No data to compare: prompts over {LONG_PROMPT_TOKENS} tokens need both a disaggregated side (the "
        "live disaggregated path, or a dpd shadow) and a monolithic one (the live direct path, or a monolithic shadow) "
        "in the same prompt-length bucket.",
    }[status]
    return Promotion(status, overhead, basis, checks, summary)


def _source(breakdown: Breakdown, index: int, *choices: tuple[Select, str]) -> tuple[Histogram | None, str]:
    for select, name in choices:
        hist = breakdown.hist(TTFT_FAMILY, index, select)
        if hist is not None and hist.count > 0:
            return hist, name
    return None, "none"


def _check(
    request_class: RequestClass,
    disaggregated: Histogram | None,
    disaggregated_source: str,
    monolithic: Histogram | None,
    monolithic_source: str,
    overhead: float,
    needed: int,
    boot: Bootstrap,
) -> PromotionCheck:
    span = request_class.span
    g, g_values = boot.estimate(disaggregated, P95, needed, f"promotion|{span}|{disaggregated_source}")
    m, m_values = boot.estimate(monolithic, P95, needed, f"promotion|{span}|{monolithic_source}")
    if g.value is None or m.value is None:
        missing = " and ".join(side for side, e in (("disaggregated", g), ("monolithic", m)) if e.value is None)
        return PromotionCheck(span, "no_data", g, disaggregated_source, m, monolithic_source, None, None, None,
                              False, f"{span}: no {missing} requests")  # fmt: skip
    margin = g.value - m.value - overhead
    low, high = interval([gv - mv - overhead for gv, mv in zip(g_values, m_values, strict=False)], boot.confidence)
    significant = low is not None and high is not None and (low > 0 or high <= 0)
    evidence = (
        f"{span}: disaggregated P95 {_ms(g.value)} ({disaggregated_source}, n={g.count:,.0f}) vs monolithic P95 "
        f"{_ms(m.value)} ({monolithic_source}, n={m.count:,.0f}) + overhead {_ms(overhead)}: margin {_ms(margin)} "
        f"({boot.confidence:.0%} CI {_ms(low)} to {_ms(high)})"
    )
    if not (g.enough and m.enough):
        return PromotionCheck(span, "not_enough_data", g, disaggregated_source, m, monolithic_source, margin, low,
                              high, significant, f"{evidence}; not enough data (each side needs {needed})")  # fmt: skip
    status = "pass" if margin <= 0 else "fail"
    sure = "significant" if significant else "not yet significant: the interval includes 0"
    return PromotionCheck(span, status, g, disaggregated_source, m, monolithic_source, margin, low, high,
                          significant, f"{evidence} -> {status} ({sure})")  # fmt: skip


def go_no_go(scrape: Scrape, opts: Options, boot: Bootstrap) -> Verdict:
    live = scrape.arms_only(lambda arm: arm != SHADOW_ARM)
    prompts = combined(live.histograms(f"{PREFIX}_prompt_tokens", ("arm", "path")).values())
    share = prompts.count_above(LONG_PROMPT_TOKENS) / prompts.count if prompts.count > 0 else None
    common = None if share is None else share > LONG_PROMPT_SHARE
    reasons = []
    if share is None:
        reasons.append("no requests: the share of long prompts is unknown")
    else:
        reasons.append(
            f"{share:.1%} of {prompts.count:,.0f} requests have prompts over {LONG_PROMPT_TOKENS} tokens "
            f"({'more' if common else 'not more'} than the {LONG_PROMPT_SHARE:.0%} DPD needs to pay)"
        )

    itl = scrape.histograms(f"{PREFIX}_inter_token_latency_seconds", ("arm", "path"))
    streams = _streams(scrape)
    needed = needed_observations(P99, opts.min_requests)
    live_itl = combined(h for (arm, _), h in itl.items() if arm_of(arm) != SHADOW_ARM)
    live_streams = sum(n for (arm, _), n in streams.items() if arm_of(arm) != SHADOW_ARM)
    itl_p99, _ = boot.estimate(
        live_itl if live_itl.count > 0 else None, P99, needed, "verdict|itl|live", units=live_streams
    )
    misses = live_itl.count_above(opts.itl_slo) / live_itl.count if live_itl.count > 0 else None
    attribution, evidence, attributed = _attribute(scrape, itl, streams, itl_p99, opts, boot, needed)
    if itl_p99.value is not None:
        reasons.append(
            f"live ITL p99 {_ms(itl_p99.value)} ({boot.confidence:.0%} CI {_ms(itl_p99.low)} to {_ms(itl_p99.high)}, "
            f"{live_itl.count:,.0f} gaps of {itl_p99.count:,.0f} streams) against the SLO {_ms(opts.itl_slo)}; "
            f"{(misses or 0.0):.2%} of the gaps miss it"
        )
    reasons.extend(evidence)

    if common is False or attributed is False:
        decision = "no_go"
    elif common and attributed:
        decision = "go"
    else:
        decision = "undecided"
    summary = {
        "go": "Go: DPD is the right tool here: long prompts are common and the ITL SLO misses come with "
        "prefilling them on the decoders.",
        "no_go": "No go: "
        + (
            f"too few long prompts ({(share or 0.0):.1%} over {LONG_PROMPT_TOKENS} tokens, not more than "
            f"{LONG_PROMPT_SHARE:.0%})"
            if common is False
            else "long prompts are common, but the ITL SLO misses are not attributable to them"
            if attribution == "not_attributed"
            else "long prompts are common, but ITL meets its SLO even where they are prefilled on the decoders: "
            "disaggregation has nothing to fix"
        )
        + ".",
        "undecided": "Undecided: "
        + ("the share of long prompts is unknown" if common is None else "long prompts are common, but ")
        + ("" if common is None else _undecided_itl(attribution))
        + ".",
    }[decision]
    return Verdict(
        decision=decision,
        long_prompt_share=share,
        long_prompt_share_needed=LONG_PROMPT_SHARE,
        long_prompts_common=common,
        itl_slo=opts.itl_slo,
        itl_p99=itl_p99,
        itl_miss_share=misses,
        attribution=attribution,
        attribution_evidence=evidence,
        itl_misses_from_long_prompts=attributed,
        summary=summary,
        reasons=reasons,
    )


def _undecided_itl(attribution: str) -> str:
    if attribution == "cannot_attribute":
        return "the data cannot tell whether the ITL SLO misses come from long prompts"
    if attribution == "undecided":
        return "the ITL difference between long prompts on decoders and disaggregated is not yet significant"
    return "there is not enough ITL data"


def _attribute(
    scrape: Scrape,
    itl: dict[tuple[str, ...], Histogram],
    streams: dict[tuple[str, ...], float],
    live_p99: Estimate,
    opts: Options,
    boot: Bootstrap,
    needed: int,
) -> tuple[str, list[str], bool | None]:
    """(attribution, evidence, whether the misses come from long prompts: None when it cannot be told)."""
    if live_p99.value is None or not live_p99.enough:
        return "cannot_attribute", [f"ITL: not enough streams ({live_p99.count:,.0f} < {needed})"], None
    units, evidence = _units(scrape, itl, streams)
    if len(units) < 2 or units[0][1] - units[-1][1] < DIRECT_SPREAD:
        most = units[0][1] if units else 1.0
        if live_p99.value <= opts.itl_slo and most >= ON_DECODERS_ENOUGH:
            evidence.append(f"ITL p99 {_ms(live_p99.value)} is within the SLO {_ms(opts.itl_slo)}")
            return "no_misses", evidence, False
        alike = (
            "the arms prefill their long prompts on the decoders alike ("
            + ", ".join(f"{name} {share:.0%}" for name, share, _, _ in units)
            + ")"
            if units
            else "there are no long prompts"
        )
        within = (
            "ITL meets its SLO with the long prompts disaggregated, and whether it would without is not in the data"
            if live_p99.value <= opts.itl_slo
            else "ITL misses its SLO, and whether long prompts cause it is not in the data"
        )
        evidence.append(
            f"{within}: {alike}; run an A/B arm with another threshold (long prompts on the decoders against "
            "disaggregated) or a monolithic shadow"
        )
        return "cannot_attribute", evidence, None
    (more, _, more_hist, more_streams), (less, _, less_hist, less_streams) = units[0], units[-1]
    a, a_values = boot.estimate(more_hist, P99, needed, f"verdict|itl|{more}", units=more_streams)
    b, b_values = boot.estimate(less_hist, P99, needed, f"verdict|itl|{less}", units=less_streams)
    if not (a.enough and b.enough) or a.value is None or b.value is None:
        evidence.append(f"ITL: not enough streams to compare ({a.count:,.0f} and {b.count:,.0f}; each needs {needed})")
        return "undecided", evidence, None
    low, high = interval([x - y for x, y in zip(a_values, b_values, strict=False)], boot.confidence)
    difference = a.value - b.value
    evidence.append(
        f"ITL p99 where long prompts are prefilled on the decoders more ({more}) {_ms(a.value)} against less "
        f"({less}) {_ms(b.value)}: {_ms(difference)} ({boot.confidence:.0%} CI {_ms(low)} to {_ms(high)})"
    )
    if more.startswith("arm ") and less.startswith("arm "):
        evidence.append(
            "arms of one router share its decoders, so one arm's long prompts also slow the other's gaps: "
            "the difference between arms understates the effect"
        )
    if a.value <= opts.itl_slo:
        evidence.append(
            f"ITL p99 meets the SLO {_ms(opts.itl_slo)} even where long prompts are prefilled on the decoders"
        )
        return "no_misses", evidence, False
    if low is not None and low > 0:
        return "attributed", evidence, True
    if (high is not None and high <= 0) or (b.value > opts.itl_slo and a.value <= b.value):
        evidence.append(
            "the ITL misses are as many where long prompts are disaggregated: they are not from long prompts"
        )
        return "not_attributed", evidence, False
    return "undecided", evidence, None


def _streams(scrape: Scrape) -> dict[tuple[str, ...], float]:
    """Streamed requests (one TTFT each) per (arm, path): the independent units ITL gaps come from, since
    one stalled stream's gaps stall together."""
    ttft = scrape.histograms(f"{PREFIX}_time_to_first_token_seconds", ("arm", "path"))
    return {key: hist.count for key, hist in ttft.items()}


def _units(
    scrape: Scrape, itl: dict[tuple[str, ...], Histogram], streams: dict[tuple[str, ...], float]
) -> tuple[list[tuple[str, float, Histogram, float]], list[str]]:
    """(name, share of long prompts prefilled on the decoders, ITL histogram, its streams) per live arm and
    shadow path, the most decoder-prefilled first."""
    breakdown = Breakdown(scrape, request_classes(()))
    long_index = next(i for i, c in enumerate(breakdown.classes) if c.long)
    units: list[tuple[str, float, Histogram, float]] = []
    evidence = []
    for arm in sorted({arm_of(arm) for arm, _ in itl} - {SHADOW_ARM}):
        hist = combined(h for (a, _), h in itl.items() if arm_of(a) == arm)
        direct = breakdown.requests(long_index, select_path(arm, "direct"))
        total = breakdown.requests(long_index, select_arm(arm))
        if total <= 0 or hist.count <= 0:
            continue
        arm_streams = sum(n for (a, _), n in streams.items() if arm_of(a) == arm)
        units.append((f"arm {arm}", direct / total, hist, arm_streams))
        evidence.append(f"arm {arm}: {direct / total:.0%} of its {total:,.0f} long prompts prefilled on the decoders")
    # The shadow's monolithic endpoint prefills every prompt itself; a staging dpd-router is taken to
    # disaggregate the long ones.
    for path, share in (("monolithic", 1.0), ("dpd", 0.0)):
        shadowed = itl.get((SHADOW_ARM, path))
        if shadowed is not None and shadowed.count > 0:
            units.append((f"shadow {path}", share, shadowed, streams.get((SHADOW_ARM, path), 0.0)))
    units.sort(key=lambda unit: (-unit[1], unit[0]))
    return units, evidence


def _ms(value: float | None) -> str:
    if value is None:
        return "-"
    return ("-" if value < 0 else "") + seconds_text(abs(value))
