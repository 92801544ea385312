"""Load scraping of engine /metrics: the parser, the scraper's bookkeeping, and a real loopback server."""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import AsyncIterator, Callable

import httpx
import pytest

from dpd_router.pool.pool import Pool
from dpd_router.pool.scrape import LoadScraper, UnreadableMetrics, parse_engine_metrics
from dpd_router.record.metrics import RouterMetrics
from dpd_router.routing.load import load_score

V1_PAGE = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 3.0
vllm:num_requests_running{engine="1",model_name="m"} 2.0
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="m"} 4.0
vllm:num_requests_waiting{engine="1",model_name="m"} 0.0
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.5
vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.25
# TYPE vllm:prefix_cache_queries counter
vllm:prefix_cache_queries_total{engine="0",model_name="m"} 1000.0
vllm:prefix_cache_queries_created{engine="0",model_name="m"} 1.7e+09
vllm:prefix_cache_hits_total{engine="0",model_name="m"} 250.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.001",model_name="m"} 0.0
vllm:num_requests_running_fake{engine="0"} 99
"""

OLD_PAGE = """\
vllm:num_requests_running{model_name="m"} 1
vllm:num_requests_waiting{model_name="m"} 2
vllm:gpu_cache_usage_perc{model_name="m"} 0.9
vllm:gpu_prefix_cache_queries_total{model_name="m"} 10
vllm:gpu_prefix_cache_hits_total{model_name="m"} 5
"""


def test_v1_names_are_summed_over_data_parallel_engines() -> None:
    parsed = parse_engine_metrics(V1_PAGE)
    assert (parsed.running, parsed.waiting) == (5.0, 4.0)
    assert parsed.kv_cache_usage == pytest.approx(0.375)
    assert (parsed.prefix_cache_hits, parsed.prefix_cache_queries) == (250.0, 1000.0)


def test_older_engine_names_are_accepted() -> None:
    parsed = parse_engine_metrics(OLD_PAGE)
    assert (parsed.running, parsed.waiting, parsed.kv_cache_usage) == (1.0, 2.0, 0.9)
    assert (parsed.prefix_cache_hits, parsed.prefix_cache_queries) == (5.0, 10.0)


def test_a_page_without_queue_gauges_is_unreadable() -> None:
    with pytest.raises(UnreadableMetrics):
        parse_engine_metrics("# nothing here\nprocess_cpu_seconds_total 3\n")


def test_a_large_page_parses() -> None:
    filler = "".join(f'vllm:some_histogram_bucket{{le="{i}",model_name="m"}} {i}\n' for i in range(20_000))
    parsed = parse_engine_metrics(filler + V1_PAGE)
    assert parsed.running == 5.0


def page(running: float, waiting: float, hits: float, queries: float) -> str:
    return (
        f"vllm:num_requests_running {running}\nvllm:num_requests_waiting {waiting}\n"
        f"vllm:prefix_cache_hits_total {hits}\nvllm:prefix_cache_queries_total {queries}\n"
    )


def scraper_with(
    respond: Callable[[httpx.Request], httpx.Response], interval: float = 2.0
) -> tuple[LoadScraper, Pool, RouterMetrics]:
    pool = Pool(["http://10.0.0.1:8100"], ["http://10.0.0.2:8200"])
    client = httpx.AsyncClient(transport=httpx.MockTransport(respond))
    metrics = RouterMetrics()
    return LoadScraper(pool, client, metrics, interval=interval, timeout=1.0), pool, metrics


async def test_a_round_records_load_and_the_hit_rate_between_scrapes() -> None:
    pages = iter([page(1, 2, 100, 1000), page(1, 2, 400, 2000), page(0, 0, 400, 2000)])

    def respond(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, text=next(pages) if request.url.host == "10.0.0.1" else page(7, 0, 0, 0))

    scraper, pool, _ = scraper_with(respond)
    prefiller, decoder = pool.prefillers[0], pool.decoders[0]
    await scraper.scrape_all()
    assert prefiller.load is not None and (prefiller.load.running, prefiller.load.waiting) == (1.0, 2.0)
    assert prefiller.load.prefix_cache_hit_rate is None  # one reading is not a rate
    assert decoder.load is not None and decoder.load.running == 7.0
    await scraper.scrape_all()
    assert prefiller.load.prefix_cache_hit_rate == pytest.approx(0.3)  # 300 hits in 1000 queries
    await scraper.scrape_all()
    assert prefiller.load.prefix_cache_hit_rate == pytest.approx(0.3)  # no queries since: kept
    assert load_score(prefiller, time.monotonic()) == 0.0


async def test_a_failed_scrape_keeps_the_last_numbers_until_they_go_stale() -> None:
    answers = iter([httpx.Response(200, text=page(4, 6, 0, 0)), httpx.Response(503), httpx.Response(200, text="x 1")])

    def respond(request: httpx.Request) -> httpx.Response:
        if request.url.host != "10.0.0.1":
            raise httpx.ConnectError("refused")
        return next(answers)

    scraper, pool, metrics = scraper_with(respond, interval=0.5)
    prefiller = pool.prefillers[0]
    assert await scraper.scrape(prefiller)
    scraped_at = prefiller.load.scraped_at  # type: ignore[union-attr]
    assert not await scraper.scrape(prefiller)
    assert not await scraper.scrape(prefiller)
    assert not await scraper.scrape(pool.decoders[0])
    assert prefiller.load is not None and prefiller.load.scraped_at == scraped_at
    assert load_score(prefiller, scraped_at + 1.0) == 4 + 2 * 6
    assert load_score(prefiller, scraped_at + 1.6) == 0.0  # older than three 0.5 s intervals
    outcomes = {
        outcome: metrics.registry.get_sample_value(
            "dpd_router_load_scrapes_total", {"endpoint": prefiller.url, "role": "prefill", "outcome": outcome}
        )
        for outcome in ("ok", "status_5xx", "unreadable")
    }
    assert outcomes == {"ok": 1.0, "status_5xx": 1.0, "unreadable": 1.0}


async def test_scraped_load_is_exported_per_endpoint_and_signal() -> None:
    scraper, pool, metrics = scraper_with(lambda request: httpx.Response(200, text=V1_PAGE))
    for endpoint in pool.endpoints():
        metrics.watch_endpoint(endpoint)

    def exported(signal: str) -> float:
        labels = {"endpoint": pool.prefillers[0].url, "role": "prefill", "signal": signal}
        value = metrics.registry.get_sample_value("dpd_router_endpoint_load", labels)
        assert value is not None
        return value

    assert math.isnan(exported("waiting"))
    await scraper.scrape_all()
    assert (exported("waiting"), exported("kv_cache_usage")) == (4.0, 0.375)
    assert 0 <= exported("age_seconds") < 5


@pytest.fixture
async def metrics_server() -> AsyncIterator[str]:
    """A tiny real HTTP server on 127.0.0.1 answering GET /metrics with V1_PAGE."""

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        request_line = await reader.readline()
        while (await reader.readline()) not in (b"\r\n", b""):
            pass
        body = V1_PAGE.encode() if request_line.startswith(b"GET /metrics ") else b"not found"
        status = b"200 OK" if request_line.startswith(b"GET /metrics ") else b"404 Not Found"
        writer.write(
            b"HTTP/1.1 " + status + b"\r\nContent-Type: text/plain; version=0.0.4\r\n"
            b"Content-Length: " + str(len(body)).encode() + b"\r\nConnection: close\r\n\r\n" + body
        )
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.close()
        await server.wait_closed()


async def test_the_scraper_reads_a_real_engine_over_loopback(metrics_server: str) -> None:
    pool = Pool([], [metrics_server])
    async with httpx.AsyncClient() as client:
        scraper = LoadScraper(pool, client, RouterMetrics(), interval=2.0, timeout=2.0)
        task = asyncio.create_task(scraper.run())
        try:
            for _ in range(200):
                if pool.decoders[0].load is not None:
                    break
                await asyncio.sleep(0.01)
        finally:
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
    load = pool.decoders[0].load
    assert load is not None and (load.running, load.waiting, load.kv_cache_usage) == (5.0, 4.0, 0.375)
