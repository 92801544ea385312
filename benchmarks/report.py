"""Summaries of a run (percentiles, throughput), results files, markdown tables and PNG plots."""

from __future__ import annotations

import json
import math
import platform
import statistics
import subprocess
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

from benchmarks.loadgen import Record, RunResult

RESULTS = Path(__file__).resolve().parent / "results"
PERCENTILES = (50, 90, 99)


def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-th percentile by linear interpolation (numpy's default); None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    position = (len(ordered) - 1) * q / 100
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def spread(values: Sequence[float]) -> dict[str, float | None]:
    out: dict[str, float | None] = {f"p{q}": percentile(values, q) for q in PERCENTILES}
    out["mean"] = statistics.fmean(values) if values else None
    return out


def summarize(records: Iterable[Record], wall: float) -> dict[str, Any]:
    """TTFT, TPOT, ITL (every gap), E2E spreads in seconds, plus counts and throughput."""
    records = list(records)
    ok = [r for r in records if r.ok]
    gaps = [g for r in ok for g in r.gaps]
    out_tokens = sum(r.tokens_out for r in ok)
    return {
        "requests": len(records),
        "ok": len(ok),
        "errors": len(records) - len(ok),
        "error_samples": sorted({r.error for r in records if r.error})[:3],
        "tokens_in": sum(r.tokens_in or r.prompt_tokens for r in ok),
        "tokens_out": out_tokens,
        "wall_s": wall,
        "req_per_s": len(ok) / wall if wall > 0 else None,
        "out_tok_per_s": out_tokens / wall if wall > 0 else None,
        "chunks_per_s": sum(r.chunks for r in ok) / wall if wall > 0 else None,
        "ttft": spread([r.ttft for r in ok if r.ttft is not None]),
        "tpot": spread([t for r in ok if (t := r.tpot) is not None]),
        "itl": spread(gaps),
        "e2e": spread([r.e2e for r in ok if r.e2e is not None]),
    }


def summarize_run(result: RunResult, *, by_class: bool = True) -> dict[str, Any]:
    summary = {"all": summarize(result.records, result.wall)}
    if by_class:
        classes = sorted({r.cls for r in result.records})
        if len(classes) > 1:
            for cls in classes:
                summary[cls] = summarize([r for r in result.records if r.cls == cls], result.wall)
    return summary


def median_of(values: Iterable[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def environment() -> dict[str, Any]:
    """What machine and code produced a result."""
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=False, timeout=5
        ).stdout.strip()
        dirty = bool(
            subprocess.run(
                ["git", "status", "--porcelain", "src"], capture_output=True, text=True, check=False, timeout=5
            ).stdout.strip()
        )
    except (OSError, subprocess.SubprocessError):
        commit, dirty = "", False
    try:
        import os

        cores = os.cpu_count()
    except Exception:  # pragma: no cover
        cores = None
    return {
        "when": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "commit": commit + ("+dirty" if dirty else ""),
        "python": platform.python_version(),
        "machine": f"{platform.machine()}, {cores} cores",
    }


def write_json(path: Path, payload: dict[str, Any]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=1, default=_jsonable) + "\n")
    return path


def finish(
    results: dict[str, Any],
    args: Any,
    *,
    started: float,
    plot: Callable[[], list[str]],
    write: Callable[[], str],
) -> None:
    """A scenario's epilogue: the environment, its arguments and duration (from monotonic `started`) into
    `results`, then the plots, `args.out/results.json`, and the markdown report printed."""
    results["env"] = environment()
    results["args"] = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    results["seconds"] = time.monotonic() - started
    results["plots"] = plot()
    write_json(args.out / "results.json", results)
    print(write())


def _jsonable(value: Any) -> Any:
    if isinstance(value, Path):
        return str(value)
    raise TypeError(f"cannot serialise {type(value).__name__}")


def ms(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value * 1000:.{digits}f}"


def num(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


def pct_change(new: float | None, base: float | None, *, lower_is_better: bool = True) -> str:
    """The seed's format: how much better `new` is than `base`, in percent (negative is worse)."""
    if new is None or base is None or base == 0:
        return "-"
    change = (base - new) / base if lower_is_better else (new - base) / base
    return f"{change * 100:+.0f}%"


def table(headers: Sequence[str], rows: Iterable[Sequence[Any]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return "\n".join(lines)


def plotting() -> Any:
    """matplotlib.pyplot with a file-only backend, or None when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt
