"""A text spelling of token ids that a server tokenizes back to exactly those ids.

The evaluation's traces are random token ids. A gateway in front of HTTP servers routes on a
request's *text* (SGLang's ``smg`` rejects a completion prompt given as token ids), and the
server tokenizes that text itself. Decoding random ids with the checkpoint's byte-level BPE
and encoding the text again does not give the ids back (BPE merges across the old token
boundaries), so a server fed that text would run other prompts than the pool runs.

``codec_checkpoint`` therefore writes a copy of a checkpoint (its files linked, not copied)
whose tokenizer is a codec: token id ``i`` is the single character ``char_of(i)`` and there
are no merges, no normaliser, no pre-tokeniser and no special tokens. Then

- ``encode(text_of(ids)) == ids`` for every id below the vocabulary size (what the server
  runs is exactly the trace's prompt);
- ``text_of(a + b) == text_of(a) + text_of(b)``: requests that share ``k`` leading tokens
  share exactly ``k`` leading characters, so a gateway's character tree sees the traces'
  prefix sharing one character per token (a real tokenizer spells a token with ~4 characters;
  smg's thresholds are ratios of matched characters, which this keeps).

Characters start at U+0100 (no ASCII, no control or JSON-escaped character) and skip the
UTF-16 surrogates, which no UTF-8 text can hold.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

FIRST = 0x100
SURROGATES = (0xD800, 0xE000)
TOKENIZER_FILES = frozenset({"tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json",
                             "merges.txt", "added_tokens.json", "chat_template.jinja"})


def char_of(token_id: int) -> str:
    code = FIRST + token_id
    if code >= SURROGATES[0]:
        code += SURROGATES[1] - SURROGATES[0]
    return chr(code)


def text_of(ids) -> str:
    return "".join(char_of(i) for i in ids)


def codec_tokenizer(vocab_size: int) -> dict:
    """``tokenizer.json`` of the codec: a BPE model with one-character tokens and no merges."""
    return {
        "version": "1.0", "truncation": None, "padding": None, "added_tokens": [],
        "normalizer": None, "pre_tokenizer": None, "post_processor": None,
        "decoder": {"type": "Fuse"},
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                  "vocab": {char_of(i): i for i in range(vocab_size)}, "merges": []},
    }


def codec_checkpoint(model: str | os.PathLike, out: Path, vocab_size: int) -> Path:
    """``out`` holds ``model``'s weights and configuration (symbolic links) and the codec as
    its tokenizer; returns ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    for entry in Path(model).resolve().iterdir():
        if entry.name not in TOKENIZER_FILES:
            (out / entry.name).symlink_to(entry)
    (out / "tokenizer.json").write_text(json.dumps(codec_tokenizer(vocab_size), ensure_ascii=False))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": None, "eos_token": None,
              "clean_up_tokenization_spaces": False, "model_max_length": 1 << 30}
    (out / "tokenizer_config.json").write_text(json.dumps(config))
    return out
