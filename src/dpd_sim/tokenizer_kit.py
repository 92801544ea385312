"""A small, locally trained tokenizer that the simulated engines and the router both load.

Nothing is downloaded: a byte-level BPE is trained on deterministic English-like text built
from a fixed word list, wrapped as a Hugging Face fast tokenizer with a Llama-3-like chat
template, and saved once to a cache directory.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

BOS_TOKEN = "<s>"
EOS_TOKEN = "</s>"
UNK_TOKEN = "<unk>"
PAD_TOKEN = "<pad>"
HEADER_START = "<|start_header_id|>"
HEADER_END = "<|end_header_id|>"
END_OF_TURN = "<|eot_id|>"
SPECIAL_TOKENS = (BOS_TOKEN, EOS_TOKEN, UNK_TOKEN, PAD_TOKEN, HEADER_START, HEADER_END, END_OF_TURN)

VOCAB_SIZE = 4000
MODEL_MAX_LENGTH = 131072
TOKENIZER_VERSION = "tokenizer-v1"

CHAT_TEMPLATE = (
    "{{- bos_token }}"
    "{%- for message in messages %}"
    "{{- '" + HEADER_START + "' + message['role'] + '" + HEADER_END + "\\n\\n' }}"
    "{%- if message['content'] is string %}"
    "{{- message['content'] }}"
    "{%- elif message['content'] is iterable and message['content'] is not mapping %}"
    "{{- message['content'] | selectattr('type', 'equalto', 'text') | map(attribute='text') | join('\\n') }}"
    "{%- endif %}"
    "{{- '" + END_OF_TURN + "' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '" + HEADER_START + "assistant" + HEADER_END + "\\n\\n' }}"
    "{%- endif %}"
)

_WORD_LIST = (
    "the of and to in is was for on that with as by at from it an be are this have or not which but "
    "they his her their one all we can there been had has more were if when will would who so about "
    "what up out into than them some could time other these two may then do first any my now such like "
    "our over man me even most made after also did many before must through back years where much your "
    "way well down should because each just those people how too little state good very make world still "
    "own see men work long get here between both life being under never day same another know while last "
    "might us great old year off come since against go came right used take three states himself few house "
    "use during without again place around however home small found thought went say part once general high "
    "upon school every does got united left number course war until always away something fact though water "
    "less public put think almost hand enough far took head yet government system better set told nothing "
    "night end why called didn find look asked later knew point next program city business give group toward "
    "young days let room president side social given present several order national possible rather second "
    "face per among form important often things looked early white case john become large big need four "
    "within felt along children saw best church ever least power development light thing seemed family "
    "interest want members others mind country area done open god service problem certain kind different "
    "thus began door help sense means whole matter perhaps itself york times law human line above name "
    "example action company hands local show whether five history gave either today act feet across taken "
    "past quite anything seen having death week experience body word half really field am car words already "
    "themselves information tell together college shall money period held keep sure probably free seems real "
    "behind cannot miss political air question making office brought whose special major heard problems "
    "federal became study ago moment available known result street economic boy position reason change south "
    "board individual job society areas west close turn love community true court force full model cache "
    "token prefill decode router engine request stream latency memory block transfer cluster server model "
    "query answer context prompt batch queue worker node network data value signal river mountain garden "
    "window morning evening summer winter music paper story market bridge island forest ocean village"
)
_WORDS = tuple(_WORD_LIST.split())

_PUNCTUATION = (".", ".", ".", ",", ",", "?", "!", ";", ":")


def default_tokenizer_dir() -> Path:
    """Where the shared tokenizer lives unless a directory is given: the user's cache."""
    cache_home = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(cache_home) / "dpd-router" / TOKENIZER_VERSION


def ensure_tokenizer(directory: Path | None = None) -> Path:
    """Return a directory holding the simulator's tokenizer, training and saving it if absent.

    The directory is written atomically (built in a sibling temporary directory, then renamed),
    so two processes racing to create it both end up loading one complete copy.
    """
    target = Path(directory) if directory is not None else default_tokenizer_dir()
    if _is_complete(target):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = target.parent / f".{target.name}.tmp-{uuid.uuid4().hex}"
    try:
        _build_tokenizer().save_pretrained(str(staging))
        _make_portable(staging)
        try:
            staging.rename(target)
        except OSError:
            if not _is_complete(target):
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def _make_portable(directory: Path) -> None:
    """Name the generic fast-tokenizer class and inline the chat template, as older loaders expect."""
    config_path = directory / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    config["chat_template"] = CHAT_TEMPLATE
    config_path.write_text(json.dumps(config, indent=2) + "\n")
    (directory / "chat_template.jinja").unlink(missing_ok=True)


def _is_complete(directory: Path) -> bool:
    return (directory / "tokenizer.json").is_file() and (directory / "tokenizer_config.json").is_file()


def _build_tokenizer() -> PreTrainedTokenizerFast:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE(unk_token=UNK_TOKEN))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_training_text(), trainer=trainer)
    bos_id = tokenizer.token_to_id(BOS_TOKEN)
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS_TOKEN} $A",
        pair=f"{BOS_TOKEN} $A {BOS_TOKEN} $B",
        special_tokens=[(BOS_TOKEN, bos_id)],
    )
    fast = PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
        tokenizer_object=tokenizer,
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        unk_token=UNK_TOKEN,
        pad_token=PAD_TOKEN,
        model_max_length=MODEL_MAX_LENGTH,
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def _training_text(lines: int = 12000) -> Iterator[str]:
    """Deterministic English-like lines: sentences from the word list, numbers, some code-ish text."""
    rng = random.Random(20240611)
    for index in range(lines):
        words = [rng.choice(_WORDS) for _ in range(rng.randint(6, 18))]
        words[0] = words[0].capitalize()
        if index % 7 == 0:
            words.insert(rng.randrange(len(words)), str(rng.randint(0, 99999)))
        if index % 11 == 0:
            words.append(f"{rng.choice(_WORDS)}_{rng.choice(_WORDS)}({rng.randint(0, 9)})")
        yield " ".join(words) + rng.choice(_PUNCTUATION)
