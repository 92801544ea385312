"""The locally trained tokenizer that engines and router share."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from transformers import AutoTokenizer

from dpd_sim.tokenizer_kit import ensure_tokenizer


def test_tokenizer_reloads_offline_with_a_chat_template(sim_tokenizer: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(str(sim_tokenizer), local_files_only=True)
    messages: list[Any] = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "hello"}, {"type": "text", "text": "world"}]},
    ]
    encoded: Any = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    ids = encoded["input_ids"] if hasattr(encoded, "keys") else encoded
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert isinstance(text, str)
    assert ids[0] == tokenizer.bos_token_id and len(ids) > 10
    assert text.startswith("<s><|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>")
    assert "hello\nworld<|eot_id|>" in text
    assert text.endswith("<|start_header_id|>assistant<|end_header_id|>\n\n")
    assert len(tokenizer) <= 4000
    assert (tokenizer.bos_token, tokenizer.eos_token, tokenizer.pad_token) == ("<s>", "</s>", "<pad>")
    config = json.loads((sim_tokenizer / "tokenizer_config.json").read_text())
    assert config["tokenizer_class"] == "PreTrainedTokenizerFast" and "chat_template" in config


def test_existing_tokenizer_is_reused(sim_tokenizer: Path) -> None:
    before = (sim_tokenizer / "tokenizer.json").stat().st_mtime_ns
    assert ensure_tokenizer(sim_tokenizer) == sim_tokenizer
    assert (sim_tokenizer / "tokenizer.json").stat().st_mtime_ns == before


def test_racing_builders_leave_one_complete_copy(tmp_path: Path) -> None:
    target = tmp_path / "tok"
    with ThreadPoolExecutor(2) as pool:
        results = list(pool.map(lambda _: ensure_tokenizer(target), range(2)))
    assert results == [target, target]
    assert sorted(path.name for path in tmp_path.iterdir()) == ["tok"]
    assert AutoTokenizer.from_pretrained(str(target), local_files_only=True)("hello")["input_ids"]
