"""Loading a model directory's tokenizer, when it has one, and turning prompts into token ids."""

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


def encode_prompt(tokenizer, prompt) -> list[int]:
    """Token ids of a prompt given as text (needs a tokenizer) or already as token ids."""
    if isinstance(prompt, str):
        if tokenizer is None:
            raise ValueError("this model directory has no tokenizer: pass token ids instead of text")
        return tokenizer.encode(prompt, add_special_tokens=False)
    return list(prompt)
