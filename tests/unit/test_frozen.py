from __future__ import annotations

from dataclasses import dataclass, field, fields, replace

import pytest

from dpd_router.pool.endpoint import Endpoint
from dpd_router.prompt.tokenizer import Prompt
from dpd_router.request.frozen import evolvable, evolve
from dpd_router.routing.planner import Plan
from dpd_router.transfer.base import StagedKV


def _same(a: object, b: object) -> None:
    assert type(a) is type(b)
    assert vars(a) == vars(b)  # fields compared or not (compare=False) alike


@pytest.mark.parametrize("cls", [Plan, StagedKV, Prompt])
def test_the_request_paths_values_are_evolvable(cls: type) -> None:
    assert evolvable(cls)


def test_an_evolved_value_is_the_value_replace_makes() -> None:
    decoder, prefiller = Endpoint("http://127.0.0.1:1", "decode"), Endpoint("http://127.0.0.1:2", "prefill")
    plan = Plan("disaggregated", "long_prompt", decoder, prefiller, uncached_tokens=900)
    changes = {"decoder_streams": 3.0, "decoder_queue": 40.0, "last_resort": True}
    _same(evolve(plan, **changes), replace(plan, **changes))
    assert evolve(plan, **changes) == replace(plan, **changes) and hash(evolve(plan)) == hash(plan)
    assert evolve(plan, decoder_streams=3.0) is not plan and plan.decoder_streams == 0.0  # the original unchanged
    staged = StagedKV({"remote_block_ids": [1]}, 900, 0)
    _same(evolve(staged, prompt_ids=[1, 2]), replace(staged, prompt_ids=[1, 2]))
    prompt = Prompt([1, 2, 3], 3, 0.1, at_most=9, at_least=lambda n: n < 5)
    _same(evolve(prompt, num_tokens=5, floor=5, at_least=None), replace(prompt, num_tokens=5, floor=5, at_least=None))
    with pytest.raises(AttributeError):
        evolve(plan).path = "direct"  # type: ignore[misc]  # still frozen


def test_a_field_the_class_lacks_is_refused_as_replace_refuses_it() -> None:
    plan = Plan("direct", "short_prompt", Endpoint("http://127.0.0.1:1", "decode"))
    with pytest.raises(TypeError, match="no field decoder_stream"):
        evolve(plan, decoder_stream=1.0)
    with pytest.raises(TypeError):
        replace(plan, decoder_stream=1.0)  # type: ignore[call-arg]


def test_classes_whose_init_does_more_are_not_evolvable() -> None:
    @dataclass(frozen=True)
    class Checked:
        size: int

        def __post_init__(self) -> None:
            assert self.size >= 0

    @dataclass(frozen=True)
    class Counted:
        size: int
        seen: list[int] = field(default_factory=list, init=False)

    @dataclass(frozen=True, slots=True)
    class Slotted:
        size: int

    assert [evolvable(cls) for cls in (Checked, Counted, Slotted, int)] == [False, False, False, False]
    assert [f.name for f in fields(Counted)] == ["size", "seen"]
