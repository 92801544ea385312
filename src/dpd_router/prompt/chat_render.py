"""The tokenizer's own chat template over a plain conversation, without `apply_chat_template`'s wrapping.

`apply_chat_template` spends about 90 us of a short request's 125 us around the template itself: it looks
the template up, copies every message through its converters (objects to dicts, None-valued keys dropped,
reasoning fields aliased, scalars stripped to JSON types), merges the special tokens into the arguments and
lets Jinja build a fresh context from the template's globals. For a conversation of plain text messages
(role, content and name, all strings: what most chat requests are) none of that changes the text: the
messages are JSON already, nothing is None, nothing is aliased, and the sandbox cannot change what it is
given. So `PlainChatTemplate` renders the same compiled template with the same arguments from a context
whose constant part (globals and special tokens) is built once. Anything else (tools, other message
fields, template arguments, continuing the final message) goes through `apply_chat_template`, and a
tokenizer whose renders differ on the startup probes does without the shortcut (`for_tokenizer`).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

log = logging.getLogger("dpd_router.tokenizer")

# The message fields a plain message may have, each a string.
_PLAIN_FIELDS = frozenset({"role", "content", "name"})

# Conversations the shortcut must render exactly as apply_chat_template does before it is used.
_PROBES: tuple[tuple[list[dict[str, Any]], bool], ...] = (
    ([{"role": "user", "content": "Hello there."}], True),
    ([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Why is the sky blue?"}], True),
    (
        [
            {"role": "system", "content": "  Spaces around.\n"},
            {"role": "user", "content": "First question?"},
            {"role": "assistant", "content": "First answer."},
            {"role": "user", "content": "Second, with a name.", "name": "ada"},
        ],
        True,
    ),
    ([{"role": "user", "content": "No generation prompt."}, {"role": "assistant", "content": "Done."}], False),
    ([{"role": "user", "content": ""}], True),
)


class PlainChatTemplate:
    """A tokenizer's default chat template, compiled by transformers, rendered for plain conversations."""

    def __init__(self, compiled: Any, constants: Mapping[str, Any]) -> None:
        self._compiled = compiled
        # The template's globals (Jinja's and transformers' raise_exception, strftime_now ...), the special
        # tokens as apply_chat_template passes them, and the arguments a plain request leaves unset.
        self._constants = {**dict(compiled.globals), **constants, "tools": None, "documents": None}

    @classmethod
    def for_tokenizer(cls, tokenizer: Any) -> PlainChatTemplate | None:
        """The shortcut for this tokenizer's default template, or None: no template, a transformers without
        the compiler it uses, or a render on the probes that differs from apply_chat_template's."""
        try:
            from transformers.utils.chat_template_utils import _compile_jinja_template, _plain_template_data

            template = tokenizer.get_chat_template()
            # The special tokens as apply_chat_template hands them over: through its converter to JSON types.
            plain = cls(_compile_jinja_template(template), _plain_template_data(dict(tokenizer.special_tokens_map)))
        except Exception as exc:  # no template, another transformers: the full path serves every request
            log.debug("chat template shortcut off: %s", exc)
            return None
        for conversation, generation in _PROBES:
            try:
                expected = tokenizer.apply_chat_template(
                    conversation, tokenize=False, add_generation_prompt=generation, continue_final_message=False
                )
            except Exception:
                continue  # a template that refuses the probe (say, no system role) is checked on the others
            try:
                rendered = plain.render(conversation, add_generation_prompt=generation)
            except Exception:
                rendered = None
            if rendered != expected:
                log.info("chat template shortcut off: it renders a probe unlike apply_chat_template")
                return None
        return plain

    @staticmethod
    def takes(conversation: Sequence[Mapping[str, Any]], tools: Any, kwargs: Mapping[str, Any]) -> bool:
        """Whether the shortcut renders this request: plain text messages, no tools, no template arguments
        beyond add_generation_prompt (a bool), not continuing the final message."""
        if tools is not None or kwargs.keys() - {"add_generation_prompt", "continue_final_message"}:
            return False
        if kwargs.get("continue_final_message") is not False or type(kwargs.get("add_generation_prompt")) is not bool:
            return False
        for message in conversation:
            if not message.keys() <= _PLAIN_FIELDS:
                return False
            for value in message.values():
                if type(value) is not str:
                    return False
        return True

    def render(self, conversation: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool) -> str:
        compiled = self._compiled
        variables = {**self._constants, "messages": conversation, "add_generation_prompt": add_generation_prompt}
        return str(compiled.environment.concat(compiled.root_render_func(compiled.new_context(variables, shared=True))))
