"""Rotary frequencies (``lmpool.model.rope``): YaRN's equal transformers' Qwen3 rotary
embedding for the same config.json, lie between the trained and the fully interpolated
ones, and a YaRN config reads back as written and lengthens the model's context."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import Qwen3Config
from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding

from lmpool.model.config import ModelConfig
from lmpool.model.rope import YarnScaling, inv_freq

BASE = dict(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=2,
            num_key_value_heads=1, head_dim=64, max_position_embeddings=40960)


@pytest.mark.parametrize("rope", [
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768},  # Qwen3's model card
    {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 4096, "beta_fast": 16, "beta_slow": 2},
    {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 2048, "truncate": False},
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8192, "attention_factor": 1.3},
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8192, "mscale": 1.0,
     "mscale_all_dim": 0.5},
], ids=["qwen3-card", "betas", "untruncated", "attention-factor", "mscale"])
@pytest.mark.parametrize("head_dim, theta", [(128, 1e6), (64, 1e4)])
def test_yarn_equals_transformers(rope, head_dim, theta):
    hf_config = {**BASE, "head_dim": head_dim, "rope_theta": theta, "rope_scaling": rope,
                 "model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"]}
    cfg = ModelConfig.from_hf_dict(hf_config)
    freq, scale = inv_freq(head_dim, cfg.rope_theta, cfg.rope_scaling)
    theirs = Qwen3RotaryEmbedding(Qwen3Config(**{k: v for k, v in hf_config.items() if k != "model_type"}))
    torch.testing.assert_close(freq, theirs.inv_freq.float(), rtol=1e-6, atol=0)
    assert scale == pytest.approx(theirs.attention_scaling, rel=1e-9)


def test_no_scaling_is_the_default_rotary():
    freq, scale = inv_freq(128, 1e6)
    expected = 1.0 / (1e6 ** (torch.arange(0, 128, 2).float() / 128))
    torch.testing.assert_close(freq, expected, rtol=0, atol=0)
    assert scale == 1.0


@settings(max_examples=60, deadline=None)
@given(factor=st.floats(1.0, 64.0), original=st.integers(16, 1 << 17), head_dim=st.sampled_from([32, 64, 128, 256]),
       theta=st.sampled_from([1e4, 5e5, 1e6]), beta_fast=st.floats(2.0, 64.0), beta_slow=st.floats(0.25, 2.0),
       truncate=st.booleans())
def test_yarn_frequencies_lie_between_trained_and_interpolated(factor, original, head_dim, theta, beta_fast,
                                                               beta_slow, truncate):
    scaling = YarnScaling(factor=factor, original_max_position_embeddings=original, beta_fast=beta_fast,
                          beta_slow=beta_slow, truncate=truncate)
    freq, scale = inv_freq(head_dim, theta, scaling)
    default, _ = inv_freq(head_dim, theta)
    assert freq.shape == (head_dim // 2,) and freq.dtype == torch.float32
    assert torch.all(freq <= default * (1 + 1e-6)) and torch.all(freq >= default / factor * (1 - 1e-6))
    assert scale >= 1.0  # the attention factor only ever sharpens


def test_a_yarn_config_reads_back_as_written_and_lengthens_the_context():
    rope = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}
    cfg = ModelConfig.from_hf_dict({**BASE, "rope_theta": 1e6, "rope_scaling": rope, "model_type": "qwen3"})
    assert cfg.rope_scaling == YarnScaling(factor=4.0, original_max_position_embeddings=32768)
    assert cfg.max_context == 131072 and cfg.max_position_embeddings == 40960
    assert ModelConfig.from_hf_dict(cfg.to_hf_dict()) == cfg
    # newer transformers write rope_parameters, with rope_theta inside
    nested = {**BASE, "rope_parameters": {**rope, "rope_theta": 1e6}, "model_type": "qwen3"}
    assert ModelConfig.from_hf_dict(nested) == cfg
    plain = ModelConfig.from_hf_dict({**BASE, "model_type": "qwen3"})
    assert plain.rope_scaling is None and plain.max_context == 40960


def test_bad_yarn_parameters_are_refused():
    for missing in ("factor", "original_max_position_embeddings"):
        rope = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}
        del rope[missing]
        with pytest.raises(ValueError, match=f"YaRN rope scaling needs {missing}"):
            ModelConfig.from_hf_dict({**BASE, "rope_scaling": rope, "model_type": "qwen3"})
    with pytest.raises(ValueError, match="factor must be >= 1"):
        YarnScaling(factor=0.5, original_max_position_embeddings=4096)
    with pytest.raises(ValueError, match="original_max_position_embeddings must be positive"):
        YarnScaling(factor=2.0, original_max_position_embeddings=0)


def test_the_engine_serves_yarn_context_beyond_the_trained_positions(tmp_path):
    from lmpool import LLM, SamplingParams
    from lmpool.model.make_model import make_model

    model = make_model(tmp_path / "m", preset="tiny", overrides=dict(
        max_position_embeddings=64, rope_scaling=YarnScaling(factor=4.0, original_max_position_embeddings=64)))
    with LLM(str(model), block_size=16, num_kv_blocks=32) as llm:
        assert llm.engine.max_model_len == 256  # YaRN's context, not the 64 trained positions
        out = llm.generate([list(range(1, 201))], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))[0]
        assert len(out.token_ids) == 8
    with pytest.raises(ValueError, match="exceeds the model's context of 256 positions"):
        LLM(str(model), block_size=16, num_kv_blocks=32, max_model_len=300)
