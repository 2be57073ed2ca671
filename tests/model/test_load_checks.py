"""A checkpoint that would serve garbage is refused at load, by name: NaN or infinite
weights, a non-positive or non-finite rms_norm_eps or rope_theta, a broken rope dict or
safetensors index (a ValueError, never an AttributeError or KeyError)."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch

from lmpool import LLM
from lmpool.model.checkpoint import INDEX_FILE, NonFiniteWeightError, iter_safetensors, save_safetensors
from lmpool.model.config import ModelConfig
from lmpool.model.make_model import make_model


@pytest.fixture
def model_dir(tiny_model, tmp_path) -> Path:
    """A private copy of the tiny checkpoint, to break."""
    return Path(shutil.copytree(tiny_model, tmp_path / "model"))


def rewrite_config(path: Path, **changes) -> None:
    config = json.loads((path / "config.json").read_text())
    config.update(changes)
    (path / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_non_finite_weights_are_refused_naming_the_tensor(model_dir, bad):
    tensors = dict(iter_safetensors(model_dir))
    name = next(n for n in tensors if n.endswith("mlp.down_proj.weight"))
    tensors[name][3, 5] = bad
    for file in model_dir.glob("*.safetensors"):
        file.unlink()
    save_safetensors(tensors, model_dir)
    with pytest.raises(NonFiniteWeightError, match=f"weight {name} .* holds"):
        LLM(str(model_dir))


@pytest.mark.parametrize("changes, match", [
    ({"rms_norm_eps": -1e-6}, "rms_norm_eps must be a finite number > 0"),
    ({"rms_norm_eps": 0}, "rms_norm_eps must be a finite number > 0"),
    ({"rms_norm_eps": "tiny"}, "rms_norm_eps must be a number"),
    ({"rope_theta": 0}, "rope_theta must be a finite number > 0"),
    ({"rope_theta": -10000.0}, "rope_theta must be a finite number > 0"),
    ({"rope_theta": [1]}, "rope_theta must be a number"),
    ({"rope_scaling": "yarn"}, "rope_scaling must be a JSON object"),
    ({"rope_scaling": ["yarn"]}, "rope_scaling must be a JSON object"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": "big", "original_max_position_embeddings": 4096}},
     "rope_scaling is not a valid YaRN scaling"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": -1}}, "rope_theta must be a finite number > 0"),
    ({"eos_token_id": [True]}, "token ids must be integers"),
])
def test_broken_configs_are_refused_naming_the_key(model_dir, changes, match):
    rewrite_config(model_dir, **changes)
    with pytest.raises(ValueError, match=match):
        ModelConfig.from_pretrained(model_dir)


@pytest.mark.parametrize("index, match", [
    ("{not json", "is not valid JSON"),
    ("[]", "non-empty \"weight_map\""),
    ('{"metadata": {}}', "non-empty \"weight_map\""),
    ('{"weight_map": ["model.safetensors"]}', "non-empty \"weight_map\""),
    ('{"weight_map": {"x": 5}}', "maps 'x' to 5"),
    ('{"weight_map": {"x": "../model.safetensors"}}', "not a \\*.safetensors file name in its directory"),
    ('{"weight_map": {"x": "/etc/passwd"}}', "not a \\*.safetensors file name"),
])
def test_broken_index_files_are_refused(tmp_path, index, match):
    path = make_model(tmp_path / "sharded", preset="tiny")
    (path / INDEX_FILE).write_text(index)
    with pytest.raises(ValueError, match=match):
        list(iter_safetensors(path))
    assert torch.isfinite(next(iter(dict(iter_safetensors(path / "model.safetensors")).values()))).all()
