"""The recommended prefill:decode ratio: the work each pool does from the token counts, checked against
the pools' scraped load (point 5 of the `dpd_router.advise` package docstring)."""

from __future__ import annotations

import math
from collections import defaultdict

from dpd_router.advise.histogram import Histogram
from dpd_router.advise.report import Options, PoolLoad, RatioAdvice
from dpd_router.advise.scrape import Scrape
from dpd_router.record.metrics import PREFIX

# The load check: a pool "queues" at this many waiting requests per engine, is "idle" below the other.
QUEUEING_WAITING = 1.0
IDLE_WAITING = 0.5
KV_CACHE_FULL = 0.9


RATIO_HEURISTIC = (
    "prefill work = disaggregated prompt tokens / prefill rate; decode work = output tokens / decode rate + "
    "direct prompt tokens / prefill rate (decoders prefill the direct prompts themselves); ratio = prefill work / "
    "decode work, as small integers and split over the engines the router has now. Rates are one engine's "
    "capacity (--prefill-rate {p:g} prompt tokens/s, --decode-rate {d:g} output tokens/s): measure yours. "
    "Then the scraped load: a pool with requests waiting (>= {q:g} per engine, or decoders' KV cache >= {kv:.0%}) "
    "while the other has none (< {i:g}) gets one engine more than the token counts alone give."
)


def _simple_ratio(ratio: float) -> str:
    """p:d in small integers closest to `ratio` on a log scale (ties: fewer engines)."""
    if ratio <= 0:
        return "0:1"
    candidates = {(p, d) for p in range(1, 5) for d in range(1, 5)}
    candidates |= {(n, 1) for n in range(1, 17)} | {(1, n) for n in range(1, 17)}
    p, d = min(candidates, key=lambda c: (round(abs(math.log(c[0] / c[1]) - math.log(ratio)), 9), c[0] + c[1]))
    return f"{p}:{d}"


def _split(ratio: float, engines: int) -> dict[str, int]:
    if engines < 2:
        return {"prefill": 0 if ratio <= 0 else 1, "decode": max(engines, 1)}
    if ratio <= 0:
        return {"prefill": 0, "decode": engines}
    prefill = min(max(round(engines * ratio / (1 + ratio)), 1), engines - 1)
    return {"prefill": prefill, "decode": engines - prefill}


def _pool_loads(scrape: Scrape) -> dict[str, PoolLoad]:
    endpoints: dict[str, set[str]] = defaultdict(set)
    signals: dict[tuple[str, str], dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    in_flight: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for labels, value in scrape.gauge_values(f"{PREFIX}_endpoint_load"):
        role, endpoint = labels.get("role", ""), labels.get("endpoint", "")
        endpoints[role].add(endpoint)
        if value == value:  # NaN: not scraped yet, or the engine lacks the signal
            signals[(role, labels.get("signal", ""))][endpoint].append(value)
    for name in (f"{PREFIX}_endpoint_in_flight_requests", f"{PREFIX}_endpoint_healthy"):
        for labels, value in scrape.gauge_values(name):
            role, endpoint = labels.get("role", ""), labels.get("endpoint", "")
            endpoints[role].add(endpoint)
            if name.endswith("in_flight_requests"):
                in_flight[role][endpoint] += value  # every router's open calls to that engine

    def per_engine(role: str, signal: str) -> float | None:
        # Several routers scrape the same engine: average their readings, then the engines'.
        readings = [sum(values) / len(values) for values in signals[(role, signal)].values() if values]
        return sum(readings) / len(readings) if readings else None

    out = {}
    for role in ("prefill", "decode"):
        count = len(endpoints.get(role, ()))
        flights = list(in_flight[role].values())
        out[role] = PoolLoad(
            engines=count,
            waiting_per_engine=per_engine(role, "waiting"),
            running_per_engine=per_engine(role, "running"),
            kv_cache_usage=per_engine(role, "kv_cache_usage"),
            router_in_flight_per_engine=sum(flights) / len(flights) if flights else None,
        )
    return out


def _queueing(load: PoolLoad, role: str) -> bool:
    waiting = load.waiting_per_engine or 0.0
    full = role == "decode" and (load.kv_cache_usage or 0.0) >= KV_CACHE_FULL
    return waiting >= QUEUEING_WAITING or full


def _idle(load: PoolLoad) -> bool:
    return load.engines > 0 and (load.waiting_per_engine or 0.0) < IDLE_WAITING


def ratio_advice(
    scrape: Scrape,
    prompt_by_path: dict[tuple[str, ...], Histogram],
    prompt_all: Histogram,
    opts: Options,
    recommended_threshold: int | None,
) -> RatioAdvice:
    prefill_tokens = prompt_by_path.get(("disaggregated",), Histogram([math.inf], [0.0], 0.0)).sum
    direct_tokens = prompt_by_path.get(("direct",), Histogram([math.inf], [0.0], 0.0)).sum
    output_tokens = scrape.histogram(f"{PREFIX}_output_tokens").sum
    heuristic = RATIO_HEURISTIC.format(
        p=opts.prefill_rate, d=opts.decode_rate, q=QUEUEING_WAITING, kv=KV_CACHE_FULL, i=IDLE_WAITING
    )

    def work(prefill: float, direct: float) -> tuple[float, float, float | None]:
        prefill_work = prefill / opts.prefill_rate
        decode_work = output_tokens / opts.decode_rate + direct / opts.prefill_rate
        return prefill_work, decode_work, (prefill_work / decode_work if decode_work > 0 else None)

    prefill_work, decode_work, ratio = work(prefill_tokens, direct_tokens)
    load = _pool_loads(scrape)
    engines = load["prefill"].engines + load["decode"].engines
    current = f"{load['prefill'].engines}:{load['decode'].engines}" if engines else None
    split = _split(ratio, engines) if ratio is not None and engines else None

    notes: list[str] = []
    recommended = _simple_ratio(ratio) if ratio is not None else None
    if split is not None:
        prefill_queues = _queueing(load["prefill"], "prefill") and _idle(load["decode"])
        decode_queues = _queueing(load["decode"], "decode") and _idle(load["prefill"])
        if prefill_queues and split["prefill"] <= load["prefill"].engines and split["decode"] > 1:
            split = {"prefill": split["prefill"] + 1, "decode": split["decode"] - 1}
            recommended = f"{split['prefill']}:{split['decode']}"
            notes.append("the prefill pool has requests waiting and the decode pool none: one engine moved to prefill")
        elif decode_queues and split["decode"] <= load["decode"].engines and split["prefill"] > 1:
            split = {"prefill": split["prefill"] - 1, "decode": split["decode"] + 1}
            recommended = f"{split['prefill']}:{split['decode']}"
            notes.append(
                "the decode pool is queueing (requests waiting or KV cache full) and the prefill pool is not: "
                "one engine moved to decode"
            )
        elif prefill_queues or decode_queues:
            pool = "prefill" if prefill_queues else "decode"
            notes.append(f"the {pool} pool is queueing now, which the recommended split already addresses")
    if not any(pool.waiting_per_engine is not None for pool in load.values()):
        notes.append(
            "no engine load in the scrape (the router has not scraped the engines' /metrics): token counts only"
        )
    elif not notes:
        notes.append("neither pool is queueing on its own: the token counts decide")

    at_threshold = None
    if recommended_threshold is not None and prompt_all.count > 0:
        above = prompt_all.sum_above(recommended_threshold)
        p_work, d_work, r = work(above, prompt_all.sum - above)
        at_threshold = {
            "threshold": recommended_threshold,
            "prefill_prompt_tokens": above,
            "prefill_work": p_work,
            "decode_work": d_work,
            "ratio": r,
            "recommended": _simple_ratio(r) if r is not None else None,
            "split": _split(r, engines) if r is not None and engines else None,
        }
    return RatioAdvice(
        prefill_rate=opts.prefill_rate,
        decode_rate=opts.decode_rate,
        prefill_prompt_tokens=prefill_tokens,
        direct_prompt_tokens=direct_tokens,
        output_tokens=output_tokens,
        prefill_work=prefill_work,
        decode_work=decode_work,
        ratio=ratio,
        recommended=recommended,
        split=split,
        current=current,
        at_recommended_threshold=at_threshold,
        load=load,
        load_check="; ".join(notes),
        heuristic=heuristic,
    )
