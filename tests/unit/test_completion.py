"""A request's record is written once, as it ends: who asked and the prompt as read with what the hops produced."""

from __future__ import annotations

import asyncio

from dpd_router.gateway.completion import Completion
from dpd_router.record.metrics import RouterMetrics
from dpd_router.record.observe import Asked, Observer, RequestTrace


def asked(**changes: object) -> Asked:
    fields: dict[str, object] = {
        "request_id": "r-1",
        "kind": "chat",
        "stream": False,
        "started": 100.0,
        "queue_seconds": 0.25,
        "tenant": "acme",
        "model": "m",
        "adapter": "sql",
        "key_id": "k1",
    } | changes
    return Asked(**fields)  # type: ignore[arg-type]


def test_the_record_takes_who_asked_and_the_prompt_as_read_when_the_request_ends() -> None:
    metrics = RouterMetrics()
    observer = Observer(metrics)
    done = Completion(asked(), observer, metrics)
    done.asked_by(asked(arm="b"))  # its planner's arm, known after it started
    done.read(420, 0.002)
    assert not observer.recent and not done.ended
    done.output.decoder = "http://127.0.0.1:8200"
    done()
    ((_, line),) = observer.recent
    assert (line["model"], line["adapter"], line["tenant"], line["key_id"], line["arm"]) == (
        "m",
        "sql",
        "acme",
        "k1",
        "b",
    )
    assert (line["prompt_tokens"], line["tokenize_ms"], line["queue_ms"]) == (420, 2.0, 250.0)
    assert line["decoder"] == "http://127.0.0.1:8200" and done.ended
    done()  # once: nothing more is recorded
    assert len(observer.recent) == 1


async def test_a_prompt_counted_after_the_end_is_reported_with_the_count_its_report_settles() -> None:
    metrics = RouterMetrics()
    observer = Observer(metrics)
    done = Completion(asked(), observer, metrics)
    done.read(None, 0.001)  # planned on its first tokens: counted later
    whole: asyncio.Future[int] = asyncio.get_running_loop().create_future()

    def settle(trace: RequestTrace) -> None:
        trace.prompt_tokens = whole.result()

    done.report_after(whole, settle)
    done()
    assert not observer.recent, "reported once the count comes"
    whole.set_result(4096)
    await asyncio.sleep(0)
    ((_, line),) = observer.recent
    assert line["prompt_tokens"] == 4096 and line["model"] == "m"
