"""Where the scrape to advise on comes from: routers' live `/metrics` (over HTTP), saved files, and
earlier scrapes to subtract."""

from __future__ import annotations

import argparse
import asyncio
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from urllib.parse import urlsplit

from dpd_router.advise.scrape import AdviseError, Scrape


def metrics_url(url: str) -> str:
    """`http://host:port` or `.../metrics`: the /metrics URL."""
    parts = urlsplit(url if "://" in url else f"http://{url}")
    if parts.path in ("", "/"):
        return parts._replace(path="/metrics").geturl()
    return parts.geturl()


async def fetch_scrapes(urls: Sequence[str], wait: float = 10.0) -> list[str]:
    """The /metrics texts of the routers, fetched concurrently (each within `wait` seconds)."""
    import httpx

    async with httpx.AsyncClient(timeout=wait) as client:

        async def one(url: str) -> str:
            try:
                response = await client.get(url)
                response.raise_for_status()
            except httpx.HTTPError as exc:
                raise AdviseError(f"cannot read {url}: {exc or type(exc).__name__}") from None
            return response.text

        return list(await asyncio.gather(*(one(url) for url in urls)))


def _combine(texts: Iterable[str]) -> Scrape:
    total = Scrape()
    for text in texts:
        total = total.plus(Scrape.parse(text))
    return total


async def collect(args: argparse.Namespace) -> tuple[Scrape, list[str]]:
    """The scrape to advise on, from the arguments, and a description of where it came from."""
    if bool(args.metrics) == bool(args.file):
        raise AdviseError("give either --metrics URL or --file FILE")
    if args.window is not None and not args.metrics:
        raise AdviseError("--window needs --metrics")
    sources: list[str]
    if args.metrics:
        urls = [metrics_url(url) for url in args.metrics]
        sources = list(urls)
        texts = await fetch_scrapes(urls, args.timeout)
        scrape = _combine(texts)
        if args.window is not None:
            await asyncio.sleep(args.window)
            scrape = _combine(await fetch_scrapes(urls, args.timeout)).minus(scrape)
            sources.append(f"traffic over {args.window:g} s")
    else:
        texts = [_read(path) for path in args.file]
        sources = list(args.file)
        scrape = _combine(texts)
    if scrape.empty:
        raise AdviseError(f"no dpd_router_* metrics in {', '.join(sources)}: is this a dpd-router /metrics?")
    if args.since:
        scrape = scrape.minus(_combine(_read(path) for path in args.since))
        sources.append("since " + ", ".join(args.since))
    return scrape, sources


def _read(path: str) -> str:
    try:
        return Path(path).read_text()
    except OSError as exc:
        raise AdviseError(f"cannot read {path}: {exc.strerror or exc}") from None


def observed_hours(args: argparse.Namespace) -> tuple[float | None, str]:
    """How long the traffic advised on took, in hours, and how that is known: `--hours`, the `--window`,
    or with `--since` the time between the scrapes (the files' modification times, as `curl > FILE` leaves
    them; now, for live `--metrics`). A whole scrape without those has no known start."""
    if getattr(args, "hours", None) is not None:
        return args.hours, "--hours"
    if args.window is not None:
        return args.window / 3600, "--window"
    if args.since:
        try:
            earlier = max(Path(path).stat().st_mtime for path in args.since)
            later = time.time() if args.metrics else max(Path(path).stat().st_mtime for path in args.file)
        except OSError:
            return None, "unknown"
        if later > earlier:
            return (later - earlier) / 3600, "the times the scrapes were saved (--since)"
    return None, "unknown"
