"""Reading and writing model weights as safetensors in the Hugging Face layout.

Owns the on-disk weight format: either one ``model.safetensors`` or shards
``model-0000i-of-0000n.safetensors`` with a ``model.safetensors.index.json`` that maps
every tensor name to its shard.

Invariants:
- weights are only ever read with ``safe_open`` (never pickle), one tensor at a time, so
  reading a checkpoint never holds more than one tensor beyond what the caller keeps.
- when an index exists it is authoritative: exactly the files it names are read, and a
  missing one is an error rather than a silently partial model.
- a written shard never exceeds ``max_shard_bytes`` unless a single tensor does.
- every floating-point tensor read is finite: a NaN or infinity in the weights is a
  ``NonFiniteWeightError`` naming the tensor, at load, not a model that emits token 0.
- an index is validated: a JSON object whose ``weight_map`` maps names to plain file names
  in the checkpoint directory; anything else is a ``ValueError`` naming the problem.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
# transformers refuses safetensors files whose metadata does not name the framework.
_METADATA = {"format": "pt"}


class NonFiniteWeightError(ValueError):
    """A weight tensor holds NaN or infinity."""


def iter_safetensors(path: str | Path, check_finite: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(name, tensor)`` for every tensor of the checkpoint in directory ``path``
    (or of the single safetensors file ``path``); with ``check_finite``, raise
    ``NonFiniteWeightError`` at the first floating-point tensor holding NaN or infinity."""
    for file in _safetensors_files(Path(path)):
        try:
            opened = safe_open(file, framework="pt", device="cpu")
        except Exception as e:  # safetensors' own error type differs between its versions
            raise ValueError(f"cannot read weights file {file}: {e}") from None
        with opened as f:
            for name in f.keys():
                tensor = f.get_tensor(name)
                if check_finite:
                    check_finite_tensor(name, tensor, file)
                yield name, tensor


def check_finite_tensor(name: str, tensor: torch.Tensor, file: Path | str = "") -> None:
    """Raise ``NonFiniteWeightError`` if floating-point ``tensor`` holds NaN or infinity."""
    if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
        nan, inf = int(torch.isnan(tensor).sum()), int(torch.isinf(tensor).sum())
        raise NonFiniteWeightError(f"weight {name} in {file} holds {nan} NaN and {inf} infinite values")


def _safetensors_files(path: Path) -> list[Path]:
    if path.is_file():
        return [path]
    if not path.is_dir():
        raise FileNotFoundError(f"checkpoint directory not found: {path}")
    index = path / INDEX_FILE
    if index.is_file():
        files = [path / name for name in sorted(set(_weight_map(index).values()))]
        for file in files:
            if not file.is_file():
                raise FileNotFoundError(f"{index} names {file.name}, which does not exist")
        return files
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {path}")
    return files


def _weight_map(index: Path) -> dict[str, str]:
    """The index's tensor name -> file name map, checked: file names are plain names of
    ``*.safetensors`` files in the index's directory (no path leaves it)."""
    try:
        data = json.loads(index.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{index} is not valid JSON: {e}") from None
    weight_map = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise ValueError(f"{index} must be a JSON object with a non-empty \"weight_map\" object")
    for name, file in weight_map.items():
        if not isinstance(file, str) or Path(file).name != file or not file.endswith(".safetensors"):
            raise ValueError(f"{index} maps {name!r} to {file!r}, not a *.safetensors file name in its directory")
    return weight_map


def save_safetensors(
    tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
    path: str | Path,
    max_shard_bytes: int | None = None,
) -> list[Path]:
    """Write ``tensors`` into directory ``path``; return the files written.

    Without ``max_shard_bytes`` everything goes into one ``model.safetensors``. With it,
    tensors are packed in order into shards plus an index. An iterable of pairs is
    consumed lazily, so a caller that generates tensors one by one holds at most one
    shard in memory.
    """
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    items = tensors.items() if isinstance(tensors, Mapping) else tensors
    if max_shard_bytes is None:
        save_file({name: t.contiguous() for name, t in items}, path / SINGLE_FILE, _METADATA)
        return [path / SINGLE_FILE]

    # The final names carry the shard count, unknown until the input is exhausted, so
    # shards are written under temporary names and renamed at the end.
    shards: list[list[str]] = []
    total = 0
    current: dict[str, torch.Tensor] = {}
    current_bytes = 0

    def flush() -> None:
        save_file(current, path / f".shard-{len(shards)}.tmp", _METADATA)
        shards.append(list(current))
        current.clear()

    for name, tensor in items:
        size = tensor.numel() * tensor.element_size()
        if current and current_bytes + size > max_shard_bytes:
            flush()
            current_bytes = 0
        current[name] = tensor.contiguous()
        current_bytes += size
        total += size
    if current or not shards:
        flush()

    weight_map: dict[str, str] = {}
    files = []
    for i, names in enumerate(shards):
        file = path / f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        (path / f".shard-{i}.tmp").rename(file)
        files.append(file)
        weight_map.update(dict.fromkeys(names, file.name))
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (path / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    return files
