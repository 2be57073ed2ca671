"""Loading a model directory's tokenizer, when it has one."""

from __future__ import annotations

from pathlib import Path

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json")


def load_tokenizer(model_dir: str | Path):
    """The directory's Hugging Face tokenizer, or None if it ships none (token ids only)."""
    path = Path(model_dir)
    if not any((path / name).exists() for name in TOKENIZER_FILES):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path))
