"""The operator console in a real headless Chromium: what it shows is what /metrics says, a dead
prefiller turns red, and a threshold changed from the page routes the next request."""

from __future__ import annotations

import os
from pathlib import Path

import httpx
import pytest

from dpd_router.api.auth import hash_key
from dpd_sim.cluster import SimCluster
from tests.integration.conftest import MODEL, chat_body, cluster_settings, metric, running_router
from tests.tools import required_tool

ADMIN_KEY = "console-admin-key"
THRESHOLD = 64
LONG = "Every region reported steady growth while costs stayed flat across the whole year. " * 10
SHORT = "Hi there."


@pytest.fixture
def chromium() -> str:
    return required_tool("chromium", "chromium-browser", package="chromium", purpose="the browser test")


async def test_the_console_shows_the_routing_live_and_changes_the_threshold(
    chromium: str, tokenizer_dir: Path, tmp_path: Path
) -> None:
    from playwright.async_api import async_playwright, expect

    async with (
        SimCluster(prefill=2, decode=1, tokenizer=tokenizer_dir, model=MODEL) as cluster,
        running_router(
            **cluster_settings(cluster, tokenizer_dir, threshold=THRESHOLD, admin_key_hashes=[hash_key(ADMIN_KEY)])
        ) as base_url,
        httpx.AsyncClient(base_url=base_url, timeout=30) as client,
        async_playwright() as playwright,
    ):
        for i in range(8):
            answer = await client.post("/v1/chat/completions", json=chat_body(f"{i} {LONG if i < 3 else SHORT}"))
            assert answer.status_code == 200
        browser = await playwright.chromium.launch(executable_path=chromium, args=["--no-sandbox"])
        page = await browser.new_page(viewport={"width": 1400, "height": 1100})
        await page.goto(f"{base_url}/ui")
        # Without the admin key the page says what it needs; with it, it shows the router.
        await expect(page.locator("#status")).to_contain_text("admin key")
        await page.fill("#key", ADMIN_KEY)
        await page.dispatch_event("#key", "change")

        # The decisions the page shows are the router's own counts.
        long_row = page.locator('#reason-table tr[data-path="disaggregated"][data-reason="long_prompt"] td').nth(2)
        short_row = page.locator('#reason-table tr[data-path="direct"][data-reason="below_threshold"] td').nth(2)
        await expect(long_row).to_have_text("3", timeout=15_000)
        await expect(short_row).to_have_text("5")
        assert await metric(base_url, "dpd_router_route_decisions_total", {"reason": "long_prompt"}) == 3
        assert await metric(base_url, "dpd_router_route_decisions_total", {"reason": "below_threshold"}) == 5
        await expect(page.locator("#recent-table tbody tr")).to_have_count(8)
        await expect(page.locator("#pool-table tbody tr")).to_have_count(3)
        # A request clicked shows its phases.
        first = page.locator("#recent-table tbody tr").first
        request_id = await first.get_attribute("data-id")
        await first.click()
        await expect(page.locator("#detail")).to_contain_text(str(request_id))
        await expect(page.locator("#detail")).to_contain_text("to first token")

        # A prefiller killed turns red.
        dead = cluster.engines[0]
        await cluster.kill(dead)
        dead_row = page.locator(f'#pool-table tr[data-url="{dead.url}"]')
        await expect(dead_row).to_have_class("down", timeout=15_000)
        await page.screenshot(path=str(screenshot_path(tmp_path)), full_page=True)

        # A threshold raised from the page (confirmed) sends the next long prompt direct.
        page.on("dialog", lambda dialog: dialog.accept())
        await page.fill("#new-threshold", "100000")
        await page.click("#apply")
        await expect(page.locator("#change-outcome")).to_have_text("changed: routing_threshold", timeout=15_000)
        answer = await client.post("/v1/chat/completions", json=chat_body(f"after {LONG}"))
        assert answer.status_code == 200
        assert await metric(base_url, "dpd_router_route_decisions_total", {"reason": "below_threshold"}) == 6
        await expect(page.locator("#threshold")).to_have_text("100000", timeout=15_000)
        await browser.close()


def screenshot_path(tmp_path: Path) -> Path:
    """Where the screenshot goes: DPD_TEST_ARTIFACTS when set (CI keeps it), else the test's own folder."""
    folder = Path(os.environ.get("DPD_TEST_ARTIFACTS", tmp_path))
    folder.mkdir(parents=True, exist_ok=True)
    return folder / "console.png"


async def test_the_state_is_open_without_keys_and_needs_an_admin_key_with_them(
    cluster: SimCluster, tokenizer_dir: Path
) -> None:
    open_settings = cluster_settings(cluster, tokenizer_dir, threshold=THRESHOLD)
    async with running_router(**open_settings) as base_url, httpx.AsyncClient(base_url=base_url) as client:
        assert (await client.post("/v1/chat/completions", json=chat_body(SHORT))).status_code == 200
        state = (await client.get("/admin/state")).json()
        assert state["router"]["routing_threshold"] == THRESHOLD
        assert [entry["reason"] for entry in state["recent"]] == ["below_threshold"]
        assert {e["url"] for pool in state["pools"] for e in pool["endpoints"]} == {
            *cluster.prefill_urls,
            *cluster.decode_urls,
        }
        page = await client.get("/ui")
        assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    adaptive = {**open_settings, "threshold_mode": "adaptive"}
    async with running_router(**adaptive) as base_url, httpx.AsyncClient(base_url=base_url) as client:
        state = (await client.get("/admin/state")).json()
        assert {cost["model"] for cost in state["adaptive_costs"]} >= {"handoff"}
        assert [entry["decoder"] for entry in state["adaptive"]] == cluster.decode_urls
    keyed = {**open_settings, "admin_key_hashes": [hash_key(ADMIN_KEY)]}
    async with running_router(**keyed) as base_url, httpx.AsyncClient(base_url=base_url) as client:
        assert (await client.get("/admin/state")).status_code == 401
        answer = await client.get("/admin/state", headers={"Authorization": f"Bearer {ADMIN_KEY}"})
        assert answer.status_code == 200


async def test_the_transfer_wait_alarm_waits_for_a_minute_of_enough_streams(chromium: str, tokenizer_dir: Path) -> None:
    """A cold start's first streams (a prefill that compiled for seconds) set no alarm: only a minute of
    ALARM_MIN_STREAMS disaggregated streams or more is judged against the 15% line."""
    import re

    from playwright.async_api import async_playwright, expect

    async def streams(client: httpx.AsyncClient, count: int, start: int) -> None:
        for i in range(start, start + count):
            body = chat_body(f"{i} {LONG}", stream=True)
            async with client.stream("POST", "/v1/chat/completions", json=body) as answer:
                assert answer.status_code == 200
                await answer.aread()

    # The prefill takes 50 ms a call: most of a stream's TTFT however loaded the machine is (with the default
    # 5 ms, a busy test run's router steps made the share fall to the line).
    slow_prefill = {"prefill-0": ["--prefill-overhead", "0.05"]}
    async with (
        SimCluster(prefill=1, decode=1, tokenizer=tokenizer_dir, model=MODEL, engine_args=slow_prefill) as cluster,
        running_router(**cluster_settings(cluster, tokenizer_dir, threshold=THRESHOLD)) as base_url,
        httpx.AsyncClient(base_url=base_url, timeout=30) as client,
        async_playwright() as playwright,
    ):
        browser = await playwright.chromium.launch(executable_path=chromium, args=["--no-sandbox"])
        page = await browser.new_page(viewport={"width": 1400, "height": 1100})
        await page.goto(f"{base_url}/ui")
        share = page.locator("#transfer-share")
        await expect(share).to_contain_text("no disaggregated streams", timeout=15_000)
        await streams(client, 3, 0)
        await expect(share).to_contain_text("3 so far", timeout=15_000)
        # The simulated prefill is most of a long prompt's TTFT: over the line, and yet no alarm.
        early = float(re.search(r"([\d.]+)% of disaggregated TTFT", await share.inner_text()).group(1))  # type: ignore[union-attr]
        assert early > 15
        await expect(share.locator(".alarm")).to_have_count(0)
        await streams(client, 20, 3)
        await expect(share).not_to_contain_text("so far", timeout=15_000)
        text = await share.inner_text()
        percent = float(re.search(r"([\d.]+)% of disaggregated TTFT", text).group(1))  # type: ignore[union-attr]
        await expect(share.locator(".alarm")).to_have_count(1 if percent > 15 else 0)
        await browser.close()


async def test_a_console_opened_on_a_busy_router_starts_with_its_last_minutes(
    chromium: str, tokenizer_dir: Path
) -> None:
    """The charts of a page opened after the traffic are full at once, from the router's own history (with no
    request after the page opened, a page that kept only its own polls would show "no data yet" forever);
    the page fits 1,400 px, and a router without keys says how to get the key its settings need."""
    import asyncio

    from playwright.async_api import async_playwright, expect

    async with (
        SimCluster(in_process=True, prefill=1, decode=1, tokenizer=tokenizer_dir, model=MODEL) as cluster,
        running_router(**cluster_settings(cluster, tokenizer_dir, threshold=THRESHOLD)) as base_url,
        httpx.AsyncClient(base_url=base_url, timeout=30) as client,
        async_playwright() as playwright,
    ):
        for i in range(6):
            body = chat_body(f"{i} {LONG if i % 2 else SHORT}", stream=True)
            async with client.stream("POST", "/v1/chat/completions", json=body) as answer:
                assert answer.status_code == 200
                await answer.aread()

        async def sampled() -> int:
            state = (await client.get("/admin/state", params={"history": "1"})).json()
            return max(sum(row["count"] for row in s["counters"]["route_decisions_total"]) for s in state["history"])

        async with asyncio.timeout(20):
            while await sampled() < 6:  # noqa: ASYNC110 - waiting for the router's next sample
                await asyncio.sleep(0.5)

        browser = await playwright.chromium.launch(executable_path=chromium, args=["--no-sandbox"])
        page = await browser.new_page(viewport={"width": 1400, "height": 1100})
        await page.goto(f"{base_url}/ui")
        for chart in ("#rate-chart", "#ttft-chart", "#itl-chart"):
            await expect(page.locator(f"{chart} polyline").first).to_be_attached(timeout=10_000)
            await expect(page.locator(chart)).not_to_contain_text("no data yet")
        await expect(page.locator("#recent-table tbody tr")).to_have_count(6)
        fits = "(el => el.scrollWidth <= el.clientWidth)"
        assert await page.locator("#recent .scroll").evaluate(fits), "the recent requests fit without scrolling"
        assert await page.evaluate("document.documentElement.scrollWidth <= window.innerWidth")
        await expect(page.locator("#apply")).to_be_disabled()
        await expect(page.locator("#change-outcome")).to_contain_text("dpd-router hash-key")
        await browser.close()


async def test_a_console_of_two_models_shows_and_changes_each_apart(chromium: str, tokenizer_dir: Path) -> None:
    """Two models behind one router: /admin/routing and the page describe one model at a time (its settings,
    decisions and requests), the page switches between them, and a threshold applied there changes the
    model shown and no other."""
    from playwright.async_api import async_playwright, expect

    alpha_name, beta_name = "alpha-7b", "beta-70b"
    async with (
        SimCluster(in_process=True, prefill=1, decode=1, tokenizer=tokenizer_dir, model=alpha_name) as alpha,
        SimCluster(in_process=True, prefill=1, decode=1, tokenizer=tokenizer_dir, model=beta_name) as beta,
        running_router(
            tokenizer=str(tokenizer_dir),
            threshold_mode="static",
            admin_key_hashes=[hash_key(ADMIN_KEY)],
            models={
                alpha_name: {
                    "prefill_urls": alpha.prefill_urls,
                    "decode_urls": alpha.decode_urls,
                    "routing_threshold": 40,
                },
                beta_name: {
                    "prefill_urls": beta.prefill_urls,
                    "decode_urls": beta.decode_urls,
                    "routing_threshold": 100_000,
                },
            },
        ) as base_url,
        httpx.AsyncClient(base_url=base_url, timeout=30, headers={"Authorization": f"Bearer {ADMIN_KEY}"}) as client,
        async_playwright() as playwright,
    ):
        for i, model in enumerate([alpha_name] * 2 + [beta_name] * 3):
            answer = await client.post("/v1/chat/completions", json={**chat_body(f"{i} {LONG}"), "model": model})
            assert answer.status_code == 200, answer.text

        routing = (await client.get("/admin/routing")).json()
        assert (routing["model"], routing["routing_threshold"]) == (alpha_name, 40)
        assert routing["decisions"] == {"disaggregated/long_prompt": 2}
        routing = (await client.get("/admin/routing", params={"model": beta_name})).json()
        assert (routing["model"], routing["routing_threshold"]) == (beta_name, 100_000)
        assert routing["decisions"] == {"direct/below_threshold": 3}
        unknown = await client.get("/admin/routing", params={"model": "gamma"})
        assert unknown.status_code == 404 and unknown.json()["error"]["type"] == "NotFoundError"
        assert (await client.get("/admin/state", params={"model": "gamma"})).status_code == 404

        browser = await playwright.chromium.launch(executable_path=chromium, args=["--no-sandbox"])
        page = await browser.new_page(viewport={"width": 1400, "height": 1100})
        await page.goto(f"{base_url}/ui")
        await page.fill("#key", ADMIN_KEY)
        await page.dispatch_event("#key", "change")
        # The first model first: its threshold, its decisions, its requests.
        await expect(page.locator("#model-choice")).to_be_visible(timeout=15_000)
        await expect(page.locator("#threshold")).to_have_text("40")
        await expect(page.locator("#recent-table tbody tr")).to_have_count(2)
        long_rows = page.locator('#reason-table tr[data-path="disaggregated"][data-reason="long_prompt"]')
        await expect(long_rows.locator("td").nth(2)).to_have_text("2")

        await page.select_option("#model-select", beta_name)
        await expect(page.locator("#threshold")).to_have_text("100000", timeout=15_000)
        await expect(page.locator("#recent-table tbody tr")).to_have_count(3)
        short_rows = page.locator('#reason-table tr[data-path="direct"][data-reason="below_threshold"]')
        await expect(short_rows.locator("td").nth(2)).to_have_text("3")
        await expect(long_rows).to_have_count(0)

        # Beta's threshold lowered from the page: beta's next long prompt takes the prefill hop, alpha keeps 40.
        page.on("dialog", lambda dialog: dialog.accept())
        await page.fill("#new-threshold", "50")
        await page.click("#apply")
        await expect(page.locator("#change-outcome")).to_have_text("changed: models", timeout=15_000)
        answer = await client.post("/v1/chat/completions", json={**chat_body(f"after {LONG}"), "model": beta_name})
        assert answer.status_code == 200
        routing = (await client.get("/admin/routing", params={"model": beta_name})).json()
        assert routing["routing_threshold"] == 50
        assert routing["decisions"] == {"direct/below_threshold": 3, "disaggregated/long_prompt": 1}
        assert (await client.get("/admin/routing")).json()["routing_threshold"] == 40
        await expect(page.locator("#threshold")).to_have_text("50", timeout=15_000)
        await browser.close()
