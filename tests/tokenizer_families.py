"""Tokenizers of the other families a served model may have, trained here as the simulator's is (nothing is
downloaded), in the shapes their `tokenizer.json` files take: a SentencePiece-style BPE as Llama 2 and
Mistral ship it (a normalizer puts `▁` before the text and for its spaces, byte fallback), the same
vocabulary behind a Metaspace pre-tokenizer (the shape transformers converts such tokenizers to now), one
whose vocabulary has tokens running into a space (merged across words: heads cannot be read), and a BERT
WordPiece. Each is saved with the simulator's chat template, so LocalTokenizer loads it as it would a
model's."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

from dpd_sim.tokenizer_kit import (
    BOS_TOKEN,
    CHAT_TEMPLATE,
    EOS_TOKEN,
    PAD_TOKEN,
    SPECIAL_TOKENS,
    UNK_TOKEN,
    _training_text,
)

FAMILIES = ("sentencepiece", "metaspace", "crossing", "wordpiece")
MARK = "\u2581"


def build(family: str, directory: Path) -> Path:
    """The `family` tokenizer saved in `directory` (returned)."""
    tokenizer = _wordpiece() if family == "wordpiece" else _sentencepiece(family)
    fast = PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
        tokenizer_object=tokenizer,
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        unk_token="[UNK]" if family == "wordpiece" else UNK_TOKEN,
        pad_token=PAD_TOKEN,
        model_max_length=131072,
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(directory))
    return directory


def _sentencepiece(family: str) -> Tokenizer:
    """Trained on words (split at `▁`, as SentencePiece trains), then given the byte tokens and the shape
    the family ships in; "crossing" is trained on whole lines, so its merges run across spaces."""
    trained = Tokenizer(models.BPE(unk_token=UNK_TOKEN))
    trained.normalizer = normalizers.Sequence([normalizers.Prepend(MARK), normalizers.Replace(" ", MARK)])
    if family != "crossing":
        trained.pre_tokenizer = pre_tokenizers.Metaspace(replacement=MARK, prepend_scheme="never", split=True)
    trainer = trainers.BpeTrainer(
        vocab_size=3000, special_tokens=list(SPECIAL_TOKENS), initial_alphabet=[MARK], show_progress=False
    )
    trained.train_from_iterator(_training_text(4000), trainer=trainer)
    spec: dict[str, Any] = json.loads(trained.to_str())
    vocab: dict[str, int] = spec["model"]["vocab"]
    for byte in range(256):
        vocab.setdefault(f"<0x{byte:02X}>", len(vocab))
    spec["model"].update(byte_fallback=True, fuse_unk=True)
    spec["pre_tokenizer"] = None
    if family == "metaspace":
        spec["normalizer"] = None
        spec["pre_tokenizer"] = {"type": "Metaspace", "replacement": MARK, "prepend_scheme": "first", "split": False}
    tokenizer = Tokenizer.from_str(json.dumps(spec))
    tokenizer.decoder = decoders.Sequence(
        [decoders.Replace(MARK, " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    bos = tokenizer.token_to_id(BOS_TOKEN)
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS_TOKEN} $A", pair=f"{BOS_TOKEN} $A {BOS_TOKEN} $B", special_tokens=[(BOS_TOKEN, bos)]
    )
    return tokenizer


def _wordpiece() -> Tokenizer:
    tokenizer = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tokenizer.normalizer = normalizers.BertNormalizer(lowercase=True)
    tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tokenizer.decoder = decoders.WordPiece()
    specials = ["[UNK]", "[CLS]", "[SEP]", *SPECIAL_TOKENS]
    trainer = trainers.WordPieceTrainer(vocab_size=3000, special_tokens=specials, show_progress=False)
    tokenizer.train_from_iterator(_training_text(4000), trainer=trainer)
    cls, sep = tokenizer.token_to_id("[CLS]"), tokenizer.token_to_id("[SEP]")
    tokenizer.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B [SEP]", special_tokens=[("[CLS]", cls), ("[SEP]", sep)]
    )
    return tokenizer
