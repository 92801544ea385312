"""The chat template's shortcut for plain conversations renders exactly what apply_chat_template renders, for
every conversation it takes, and takes nothing else."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer

from dpd_router.prompt.chat_inputs import template_inputs
from dpd_router.prompt.chat_render import PlainChatTemplate

CHATML = (
    "{%- for message in messages %}"
    "{%- if message['role'] == 'tool' %}{{ raise_exception('no tools here') }}{%- endif %}"
    "{{- '<|im_start|>' + message['role'] + ('(' + message['name'] + ')' if message.name else '') + '\\n' }}"
    "{{- message['content'] | trim + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
    "{{- bos_token if messages | length > 3 else '' }}"
)


@pytest.fixture(scope="module", params=["own", "chatml"])
def tokenizer(request: pytest.FixtureRequest, tokenizer_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Any:
    """The test tokenizer with its own template (Llama 3's markers), and with a ChatML one that reads names,
    trims, raises and uses a special token."""
    directory = tokenizer_dir
    if request.param == "chatml":
        directory = tmp_path_factory.mktemp("chatml") / "tokenizer"
        shutil.copytree(tokenizer_dir, directory)
        config = json.loads((directory / "tokenizer_config.json").read_text())
        config["chat_template"] = CHATML
        (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return AutoTokenizer.from_pretrained(str(directory), local_files_only=True)


PIECES = [*"ab \n\t{}%#<|>'\"é漢🙂", "{{", "{%", "<s>", "<|eot_id|>", "  "]
texts = st.lists(st.sampled_from(PIECES), max_size=30).map("".join)
messages = st.fixed_dictionaries(
    {"role": st.sampled_from(["system", "user", "assistant", "tool"]), "content": texts},
    optional={"name": st.sampled_from(["ada", "", "x y"])},
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(conversation=st.lists(messages, min_size=1, max_size=6), generation=st.booleans())
def test_a_plain_conversation_renders_as_apply_chat_template_renders_it(
    tokenizer: Any, conversation: list[dict[str, str]], generation: bool
) -> None:
    plain = PlainChatTemplate.for_tokenizer(tokenizer)
    assert plain is not None
    body = {"messages": conversation, "add_generation_prompt": generation}
    chat, tools, kwargs = template_inputs(body)
    assert plain.takes(chat, tools, kwargs)
    try:
        expected: str | None = tokenizer.apply_chat_template(chat, tools=tools, tokenize=False, **kwargs)
    except Exception as exc:  # the template raised: so does the shortcut, with the same words
        with pytest.raises(type(exc), match=None) as raised:
            plain.render(chat, add_generation_prompt=generation)
        assert str(raised.value) == str(exc)
        return
    assert plain.render(chat, add_generation_prompt=generation) == expected


@pytest.mark.parametrize(
    "body",
    [
        {"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function", "function": {"name": "f"}}]},
        {"messages": [{"role": "assistant", "content": "hi", "reasoning_content": "think"}]},
        {"messages": [{"role": "assistant", "content": None, "tool_calls": []}]},
        {"messages": [{"role": "user", "content": "hi"}], "chat_template_kwargs": {"enable_thinking": False}},
        {
            "messages": [{"role": "assistant", "content": "Once upon"}],
            "continue_final_message": True,
            "add_generation_prompt": False,
        },
        {"messages": [{"role": "user", "content": "hi"}], "add_generation_prompt": 1},
        {"messages": [{"role": "user", "content": "hi", "name": 7}]},
    ],
)
def test_anything_but_a_plain_conversation_goes_through_apply_chat_template(
    tokenizer: Any, body: dict[str, Any]
) -> None:
    plain = PlainChatTemplate.for_tokenizer(tokenizer)
    assert plain is not None
    assert not plain.takes(*template_inputs(body))


def test_a_tokenizer_without_a_template_or_whose_probes_differ_has_no_shortcut(
    tokenizer: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_template(*args: Any, **kwargs: Any) -> str:
        raise ValueError("no chat template")

    with monkeypatch.context() as patched:
        patched.setattr(tokenizer, "get_chat_template", no_template)
        assert PlainChatTemplate.for_tokenizer(tokenizer) is None
    render = tokenizer.apply_chat_template
    with monkeypatch.context() as patched:  # transformers rendering something the shortcut does not
        patched.setattr(tokenizer, "apply_chat_template", lambda *a, **k: render(*a, **k) + " ")
        assert PlainChatTemplate.for_tokenizer(tokenizer) is None
