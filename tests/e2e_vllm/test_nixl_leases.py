"""No prefilled block waits for its lease on the real prefill engine (vLLM 0.32's NixlConnector).

vLLM's prefiller holds the blocks it staged for a decoder under a 30 s lease; when nobody reads
them, it logs "Releasing expired KV blocks for request <id>" and counts
`vllm:nixl_num_kv_expired_reqs`. A prefill call made here and never picked up shows the signal;
the router's requests must leave nothing behind for it.
"""

from __future__ import annotations

import asyncio
import re

from dpd_router.gateway.prefill import ORPHANED_PREFILL_GRACE
from dpd_router.transfer.nixl import PREFILL_KV_PARAMS
from dpd_sim.vllm_cpu import VllmPair
from tests.e2e_vllm.conftest import (
    REQUEST_TIMEOUT,
    _say,
    chat,
    completion,
    eventually,
    long_text,
    metric_total,
    post,
    router_for,
)
from tests.integration.conftest import local_client, settled
from tests.integration.slow_link import SlowLink

LEASE_SECONDS = 30  # vLLM's kv_lease_duration default
RELEASES_ANSWERED = 2.0  # seconds for the releases the router sent to be answered (a refusal, at once)
EXPIRED = re.compile(r"Releasing expired KV blocks for request (\S+)")
UNRECOGNIZED = re.compile(r"Potentially invalid KV blocks for unrecognized request (\S+)")


async def expired_total(pair: VllmPair) -> float:
    return await metric_total(pair.prefill.url, "vllm:nixl_num_kv_expired_reqs_total")


async def test_no_prefilled_block_waits_for_its_lease(nixl_pair: VllmPair) -> None:
    prefill, decode = nixl_pair.prefill, nixl_pair.decode
    log_start = len(prefill.log_text())
    expired_before = await expired_total(nixl_pair)

    # The signal: KV staged by a prefill call nobody picks up waits out its lease.
    staged = await post(
        prefill.url,
        "/v1/completions",
        {**completion(long_text()), "max_tokens": 1, "kv_transfer_params": PREFILL_KV_PARAMS},
    )
    control = staged["kv_transfer_params"]["remote_request_id"]

    # Why n > 1 stays direct: a decoder's n children each pull the one child's blocks a prefill
    # named, and the prefiller frees them after the first read.
    prompt = long_text()
    staged = await post(
        prefill.url, "/v1/completions", {**completion(prompt), "max_tokens": 1, "kv_transfer_params": PREFILL_KV_PARAMS}
    )
    fanned = staged["kv_transfer_params"]["remote_request_id"]
    await post(
        decode.url,
        "/v1/completions",
        {
            **completion(prompt),
            "n": 2,
            "temperature": 1.0,
            "seed": 7,
            "kv_transfer_params": staged["kv_transfer_params"],
        },
    )

    # Item 4: n > 1 through the router is served by the decoder alone.
    async with router_for(nixl_pair) as router:
        direct = await metric_total(router, "dpd_router_route_decisions_total", reason="connector_unsupported")
        for body in (
            completion(long_text(), n=3, temperature=1.0, seed=7),
            chat(long_text(), n=3, temperature=1.0, seed=7),
        ):
            path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
            assert len((await post(router, path, body))["choices"]) == 3
        async with local_client(timeout=REQUEST_TIMEOUT) as client:
            response = await client.post(
                f"{router}/v1/chat/completions", json=chat(long_text(), n=3, temperature=1.0, seed=7, stream=True)
            )
        assert response.status_code == 200 and '"index":2' in response.text.replace(" ", "")
        assert (
            await metric_total(router, "dpd_router_route_decisions_total", reason="connector_unsupported") == direct + 3
        )

    # Item 5: clients that leave once the prefiller has staged their KV, before the router read its answer.
    # The link holds the answer until the router has counted the client's leaving: held for a fixed time
    # instead, on a machine the engines starve (a step of the test process, whose loop runs the router and the
    # link, can take fifty times as long there) the router read the answer first and sent the decode call,
    # which the leaving then cut, or the answer (each piece held in turn) came after the orphan's grace.
    async with (
        SlowLink(prefill.url, hold=0.0) as link,
        router_for(nixl_pair, prefill_urls=[link.url]) as router,
        local_client(timeout=REQUEST_TIMEOUT) as client,
    ):
        for stream in (False, True):
            link.answering.clear()
            held = link.until = asyncio.Event()
            left_before = await metric_total(router, "dpd_router_client_disconnects_total")
            request = asyncio.create_task(
                client.post(f"{router}/v1/chat/completions", json=chat(long_text(), stream=stream))
            )
            answering = asyncio.create_task(link.answering.wait())
            await asyncio.wait({answering, request}, timeout=REQUEST_TIMEOUT, return_when=asyncio.FIRST_COMPLETED)
            if not answering.done():
                # Say what became of the request the link never saw answered, rather than wait on for it.
                answering.cancel()
                answered = request.result() if request.done() and request.exception() is None else None
                decisions = await metric_total(router, "dpd_router_route_decisions_total", path="disaggregated")
                raise AssertionError(
                    f"stream={stream}: no prefill answer crossed the link; the request "
                    + (f"was answered {answered.status_code}: {answered.text[:300]}" if answered else f"{request}")
                    + f"; disaggregated decisions so far: {decisions:g}"
                )
            request.cancel()
            await asyncio.gather(request, return_exceptions=True)

            async def left(before: float = left_before) -> bool:
                """The router counted the client's leaving (while its prefill's answer is held)."""
                return await metric_total(router, "dpd_router_client_disconnects_total") > before

            try:
                await eventually(left, within=REQUEST_TIMEOUT)
            finally:
                held.set()  # the prefill's answer reaches the router: the orphan's to release

        # Each left KV for nobody, which the router releases once the held answer arrives. The lease
        # check below is the proof that nothing waited for its lease; the count is reported.
        await settled(router, within=30)

        async def orphans_seen() -> dict[str, int]:
            return {
                outcome: int(await metric_total(router, "dpd_router_orphaned_prefills_total", outcome=outcome))
                for outcome in ("released", "cut", "failed")
            }

        async def both_orphans_ended() -> bool:
            """The requests are over before their prefill calls are: the router is not closed (which cuts an
            orphan's call, leaving its blocks to their lease) until both calls have ended."""
            return sum((await orphans_seen()).values()) >= 2

        try:
            await eventually(both_orphans_ended, within=ORPHANED_PREFILL_GRACE + 30)
        except AssertionError as exc:
            # Say how far it got: which orphans ended how, and where the router sent the requests.
            decisions = await metric_total(router, "dpd_router_route_decisions_total", path="disaggregated")
            raise AssertionError(
                f"{exc}; orphaned prefills by outcome: {await orphans_seen()}; disaggregated decisions: {decisions:g}"
            ) from exc
        await asyncio.sleep(RELEASES_ANSWERED)
        released = await metric_total(router, "dpd_router_kv_released_total", connector="nixl")
        # A call still unanswered after the grace (a starved machine) is cut, and one that failed left the
        # router nothing to release: what the engine staged for those waits out its lease. The router
        # counts them, and only those may expire.
        orphans = await orphans_seen()
        unreleased = orphans["cut"] + orphans["failed"]
        _say(f"clients that left as the prefill answered: 2; KV released by the router: {released:g}; {orphans}")

    # Past the lease, the prefiller has expired the control's blocks and nothing else.
    await asyncio.sleep(LEASE_SECONDS + 3)
    await post(prefill.url, "/v1/completions", {**completion("Hello"), "max_tokens": 1})  # a step to reap on

    async def control_expired() -> bool:
        return await expired_total(nixl_pair) > expired_before

    await eventually(control_expired, within=30)
    log = prefill.log_text()[log_start:]
    _say(f"prefill engine, expired: {EXPIRED.findall(log)}; unrecognized notifications: {UNRECOGNIZED.findall(log)}")
    expired = EXPIRED.findall(log)
    # The fanned-out prompt is vLLM's own business, not the router's: when both children's reads reach an idle
    # prefiller before it has registered the blocks it sent, both are "unrecognized" and the blocks wait out
    # their lease. Whether that happened is reported; every other expiry must be the control or a counted orphan.
    fanned_expired = fanned in expired
    routed = [request for request in expired if request not in (control, fanned)]
    # The same race for a request the router released: its release reached the prefiller before the
    # prefiller had registered the blocks it staged ("unrecognized"), so they waited out their lease anyway.
    # The router did release it (counted above); vLLM did not take it. Reported, not asserted.
    unrecognized = UNRECOGNIZED.findall(log)
    raced = [request for request in routed if request in unrecognized]
    assert control in expired and len(routed) - len(raced) == unreleased, routed
    assert await expired_total(nixl_pair) == expired_before + 1 + unreleased + fanned_expired + len(raced)
    if raced:
        _say(f"released by the router before the prefiller registered their blocks (vLLM's race): {raced}")
    # Reported, not asserted (vLLM's own behaviour): the fanned-out prompt's later reads name freed blocks.
    _say(
        f"decoder n=2 over one prefill: {fanned} unrecognized afterwards: {fanned in UNRECOGNIZED.findall(log)};"
        f" its blocks waited out their lease: {fanned_expired}"
    )
