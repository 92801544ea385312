from __future__ import annotations

import asyncio

import pytest

from dpd_router.api.admission import Admission, Admissions
from dpd_router.config import load_settings
from dpd_router.record.metrics import RouterMetrics
from dpd_router.request.errors import AdmissionRejected


def admission(max_in_flight: int, max_queued: int, queue_timeout: float = 5.0) -> Admission:
    return Admission(RouterMetrics(), max_in_flight=max_in_flight, max_queued=max_queued, queue_timeout=queue_timeout)


async def test_requests_beyond_the_cap_wait_in_order_and_get_the_freed_slots() -> None:
    gate = admission(1, 5)
    await gate.enter()
    order: list[int] = []

    async def wait(i: int) -> None:
        await gate.enter()
        order.append(i)

    waiting = [asyncio.create_task(wait(i)) for i in range(3)]
    await asyncio.sleep(0)
    assert gate.queued == 3 and order == []
    for _ in range(3):
        gate.leave()
        await asyncio.sleep(0)
    await asyncio.gather(*waiting)
    assert order == [0, 1, 2]
    assert gate.in_flight == 1
    gate.leave()
    assert gate.in_flight == 0


async def test_a_full_queue_rejects_at_once() -> None:
    gate = admission(1, 1)
    await gate.enter()
    queued = asyncio.create_task(gate.enter())
    await asyncio.sleep(0)
    with pytest.raises(AdmissionRejected):
        await gate.enter()
    gate.leave()
    await queued
    gate.leave()
    assert (gate.in_flight, gate.queued) == (0, 0)


async def test_a_wait_past_the_limit_is_rejected_and_leaves_no_trace() -> None:
    gate = admission(1, 4, queue_timeout=0.05)
    await gate.enter()
    with pytest.raises(AdmissionRejected):
        await gate.enter()
    assert gate.queued == 0
    gate.leave()
    assert gate.in_flight == 0


async def test_a_cancelled_waiter_gives_up_its_place() -> None:
    gate = admission(1, 4)
    await gate.enter()
    waiter = asyncio.create_task(gate.enter())
    await asyncio.sleep(0)
    waiter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiter
    assert gate.queued == 0
    gate.leave()
    assert gate.in_flight == 0


async def test_no_cap_admits_everything() -> None:
    gate = admission(0, 0)
    for _ in range(100):
        await gate.enter()
    assert gate.queued == 0


def tenant_settings(**shared: float) -> dict[str, object]:
    return {
        "decode_urls": ["http://shared:8000"],
        "tenants": {
            "acme": {"decode_urls": ["http://acme:8000"]},
            "beta": {"decode_urls": ["http://beta:8000"], "max_in_flight": 1, "max_queued": 0},
        },
        **shared,
    }


async def test_each_tenant_pool_and_the_shared_pool_have_their_own_budget() -> None:
    metrics = RouterMetrics()
    budgets = Admissions(metrics, load_settings(**tenant_settings(max_in_flight=2, max_queued=0)))
    for tenant in ("acme", None, "acme", None):
        await budgets.for_tenant(tenant).enter()
    with pytest.raises(AdmissionRejected):
        await budgets.for_tenant("acme").enter()
    assert budgets.for_tenant("keys-only-tenant") is budgets.for_tenant(None), "no reserved engines: shared budget"
    await budgets.for_tenant("beta").enter()
    with pytest.raises(AdmissionRejected):
        await budgets.for_tenant("beta").enter()
    rejected = metrics.registry.get_sample_value
    assert rejected("dpd_router_admission_rejected_total", {"reason": "queue_full", "pool": "acme"}) == 1
    assert rejected("dpd_router_admission_rejected_total", {"reason": "queue_full", "pool": "beta"}) == 1
    assert rejected("dpd_router_admission_rejected_total", {"reason": "queue_full", "pool": "shared"}) is None


def test_live_limits_reach_every_budget_a_tenant_did_not_set_itself() -> None:
    budgets = Admissions(RouterMetrics(), load_settings(**tenant_settings(max_in_flight=2)))
    budgets.reconfigure(load_settings(**tenant_settings(max_in_flight=5, queue_timeout=1.0)))
    assert (budgets.for_tenant(None).max_in_flight, budgets.for_tenant("acme").max_in_flight) == (5, 5)
    assert (budgets.for_tenant("beta").max_in_flight, budgets.for_tenant("beta").queue_timeout) == (1, 1.0)


def test_each_of_several_workers_admits_its_share_and_keeps_it_across_live_changes() -> None:
    budgets = Admissions(RouterMetrics(), load_settings(**tenant_settings(max_in_flight=5, max_queued=9, workers=2)))
    shared, beta = budgets.for_tenant(None), budgets.for_tenant("beta")
    assert (shared.max_in_flight, shared.max_queued, beta.max_in_flight) == (3, 5, 1)
    budgets.reconfigure(load_settings(**tenant_settings(max_in_flight=8, workers=2)))
    assert shared.max_in_flight == 4
