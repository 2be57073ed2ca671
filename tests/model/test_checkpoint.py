"""Tests for lmpool.model.config, lmpool.model.checkpoint and lmpool.model.make_model,
checked against transformers' own Qwen3 implementation on the same files."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer, Qwen3Config, Qwen3ForCausalLM

from lmpool.model.checkpoint import INDEX_FILE, iter_safetensors, save_safetensors
from lmpool.model.config import ModelConfig
from lmpool.model.make_model import PRESETS, SPECIAL_TOKENS, build_tokenizer, main, make_model

QWEN3_06B = {  # Qwen/Qwen3-0.6B's config.json, as published
    "architectures": ["Qwen3ForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 151643,
    "eos_token_id": 151645,
    "head_dim": 128,
    "hidden_act": "silu",
    "hidden_size": 1024,
    "initializer_range": 0.02,
    "intermediate_size": 3072,
    "max_position_embeddings": 40960,
    "max_window_layers": 28,
    "model_type": "qwen3",
    "num_attention_heads": 16,
    "num_hidden_layers": 28,
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-06,
    "rope_scaling": None,
    "rope_theta": 1000000,
    "sliding_window": None,
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.51.0",
    "use_cache": True,
    "use_sliding_window": False,
    "vocab_size": 151936,
}


def write_config(path: Path, config: dict, generation: dict | None = None) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    if generation is not None:
        (path / "generation_config.json").write_text(json.dumps(generation))
    return path


# ---- config ------------------------------------------------------------------


def test_parses_the_published_qwen3_config_and_merges_generation_eos(tmp_path):
    write_config(tmp_path, QWEN3_06B, {"eos_token_id": [151645, 151643], "bos_token_id": 151643})
    cfg = ModelConfig.from_pretrained(tmp_path)
    assert cfg == ModelConfig(**PRESETS["0.6b"], eos_token_ids=(151645, 151643), bos_token_id=151643,
                              torch_dtype="bfloat16")


def test_round_trips_through_config_json(tmp_path):
    cfg = ModelConfig(**PRESETS["tiny"], eos_token_ids=(7, 3), bos_token_id=3, attention_bias=True,
                      torch_dtype="float32")
    write_config(tmp_path, cfg.to_hf_dict())
    assert ModelConfig.from_pretrained(tmp_path) == cfg
    single = ModelConfig(**PRESETS["tiny"], eos_token_ids=(5,))
    assert single.to_hf_dict()["eos_token_id"] == 5
    assert ModelConfig.from_hf_dict(single.to_hf_dict()) == single
    # Real checkpoints name the transformers version of their format; without it some
    # transformers 5 releases warn that a local tokenizer's regex is Mistral's broken one.
    assert single.to_hf_dict()["transformers_version"] == "4.51.0"


def test_reads_what_transformers_itself_writes():
    # transformers 5 writes "dtype" and nests rope_theta in "rope_parameters".
    hf = Qwen3Config(vocab_size=1000, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=32, eos_token_id=[1, 2],
                     rope_parameters={"rope_type": "default", "rope_theta": 5e5}, dtype="float16")
    cfg = ModelConfig.from_hf_dict(hf.to_dict())
    assert (cfg.rope_theta, cfg.torch_dtype, cfg.eos_token_ids, cfg.head_dim) == (5e5, "float16", (1, 2), 32)


def test_missing_keys_default_like_transformers():
    minimal = {"model_type": "qwen3", "vocab_size": 100, "hidden_size": 64, "intermediate_size": 96,
               "num_hidden_layers": 2, "num_attention_heads": 4}
    cfg = ModelConfig.from_hf_dict(minimal)
    hf = Qwen3Config(**minimal)
    assert cfg.rope_theta == hf.rope_parameters["rope_theta"]
    assert (cfg.rms_norm_eps, cfg.max_position_embeddings) == (hf.rms_norm_eps, hf.max_position_embeddings)
    assert cfg.tie_word_embeddings == hf.tie_word_embeddings
    # Shapes transformers would take from Qwen3-8B are derived from the given ones instead.
    assert (cfg.head_dim, cfg.num_key_value_heads) == (16, 4)
    assert cfg.eos_token_ids == () and cfg.bos_token_id is None
    assert cfg.torch_dtype == "bfloat16" and cfg.attention_bias is False


def test_missing_directory_and_config_name_the_path(tmp_path):
    with pytest.raises(FileNotFoundError, match="nowhere"):
        ModelConfig.from_pretrained(tmp_path / "nowhere")
    with pytest.raises(FileNotFoundError, match=str(tmp_path)):
        ModelConfig.from_pretrained(tmp_path)


@pytest.mark.parametrize(
    "model_type, architecture",
    [("qwen3_moe", "Qwen3MoeForCausalLM"), ("llama", "LlamaForCausalLM"), ("qwen2", "Qwen2ForCausalLM")],
)
def test_rejects_other_architectures(tmp_path, model_type, architecture):
    write_config(tmp_path, {**QWEN3_06B, "model_type": model_type, "architectures": [architecture]})
    with pytest.raises(ValueError, match=rf"{model_type}.*{architecture}.*supports only.*qwen3"):
        ModelConfig.from_pretrained(tmp_path)


@pytest.mark.parametrize(
    "key", ["vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads"]
)
def test_missing_required_key_is_named(tmp_path, key):
    write_config(tmp_path, {k: v for k, v in QWEN3_06B.items() if k != key})
    with pytest.raises(ValueError, match=key):
        ModelConfig.from_pretrained(tmp_path)


@pytest.mark.parametrize(
    "change, message",
    [
        ({"num_key_value_heads": 6}, "multiple of num_key_value_heads"),
        ({"hidden_size": 0}, "hidden_size must be a positive integer"),
        ({"rope_scaling": {"rope_type": "linear", "factor": 4.0}}, "linear"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 0.5, "original_max_position_embeddings": 32768}},
         "factor must be >= 1"),
        ({"hidden_act": "gelu"}, "gelu"),
        ({"use_sliding_window": True}, "sliding"),
    ],
)
def test_rejects_inconsistent_or_unsupported_configs(tmp_path, change, message):
    write_config(tmp_path, {**QWEN3_06B, **change})
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_pretrained(tmp_path)


def test_kv_bytes_per_block():
    cfg = ModelConfig(**PRESETS["0.6b"])
    assert cfg.kv_bytes_per_block(256, torch.bfloat16) == 28 * 2 * 256 * 8 * 128 * 2
    assert cfg.kv_bytes_per_block(16, "float32") == 28 * 2 * 16 * 8 * 128 * 4


# ---- safetensors -------------------------------------------------------------


def sample_tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        f"t{i}": torch.randn(16, 8 + i, generator=g).to(dtype)
        for i, dtype in enumerate([torch.float32, torch.bfloat16, torch.float16] * 3)
    }


def test_single_file_and_shards_load_the_same_tensors(tmp_path):
    tensors = sample_tensors()
    assert save_safetensors(tensors, tmp_path / "one") == [tmp_path / "one" / "model.safetensors"]
    shards = save_safetensors(iter(tensors.items()), tmp_path / "many", max_shard_bytes=1000)
    assert len(shards) > 2
    index = json.loads((tmp_path / "many" / INDEX_FILE).read_text())
    for shard in shards:
        in_shard = [tensors[k] for k, file in index["weight_map"].items() if file == shard.name]
        assert sum(t.numel() * t.element_size() for t in in_shard) <= 1000
    assert set(index["weight_map"]) == set(tensors)
    assert set(index["weight_map"].values()) == {f.name for f in shards}
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in tensors.values())

    for directory in ("one", "many"):
        loaded = dict(iter_safetensors(tmp_path / directory))
        assert loaded.keys() == tensors.keys()
        assert all(torch.equal(loaded[k], t) and loaded[k].dtype == t.dtype for k, t in tensors.items())
    (tmp_path / "many" / INDEX_FILE).unlink()  # shards without an index still load
    assert dict(iter_safetensors(tmp_path / "many")).keys() == tensors.keys()


def test_index_naming_a_missing_shard_is_an_error(tmp_path):
    shards = save_safetensors(sample_tensors(), tmp_path, max_shard_bytes=1000)
    shards[1].unlink()
    with pytest.raises(FileNotFoundError, match=shards[1].name):
        list(iter_safetensors(tmp_path))


def test_directory_without_safetensors_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match=str(tmp_path)):
        list(iter_safetensors(tmp_path))
    with pytest.raises(FileNotFoundError, match="absent"):
        list(iter_safetensors(tmp_path / "absent"))


# ---- make_model ----------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return make_model(tmp_path_factory.mktemp("tiny"), preset="tiny", seed=0)


def hf_model(path: Path) -> Qwen3ForCausalLM:
    return Qwen3ForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def assert_hf_loads_same_tensors(path: Path) -> Qwen3ForCausalLM:
    model = hf_model(path)
    ours = dict(iter_safetensors(path))
    hf = model.state_dict()
    assert set(hf) - set(ours) <= {"lm_head.weight"}  # absent only when tied
    for name, tensor in ours.items():
        assert torch.equal(hf[name], tensor.float()), name
    return model


def greedy_distinct_fractions(model: Qwen3ForCausalLM, vocab_size: int, n_prompts: int = 4,
                              new_tokens: int = 32) -> list[float]:
    g = torch.Generator().manual_seed(1234)
    fractions = []
    for i in range(n_prompts):
        prompt = torch.randint(0, vocab_size, (1, 6 + 5 * i), generator=g)
        with torch.no_grad():
            out = model.generate(prompt, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                                 do_sample=False)
        generated = out[0, prompt.shape[1]:].tolist()
        assert len(generated) == new_tokens
        fractions.append(len(set(generated)) / new_tokens)
    return fractions


def test_tiny_checkpoint_loads_in_transformers(tiny):
    cfg = ModelConfig.from_pretrained(tiny)
    assert cfg == ModelConfig(**PRESETS["tiny"], eos_token_ids=(1023, 1021), bos_token_id=1021,
                              torch_dtype="float32")
    model = assert_hf_loads_same_tensors(tiny)
    assert model.config.rope_parameters["rope_theta"] == cfg.rope_theta
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()


def test_tiny_tokenizer_round_trips_and_matches_config(tiny):
    tok = AutoTokenizer.from_pretrained(tiny)
    text = "The harbour town woke slowly. Zero arrived late !  ünïcödé 😀 {json: [1, 2]} ,x"
    ids = tok(text)["input_ids"]
    assert tok.decode(ids) == text
    assert len(ids) < len(text.encode()) * 0.7  # the merges actually compress
    cfg = ModelConfig.from_pretrained(tiny)
    specials = tok.convert_tokens_to_ids(list(SPECIAL_TOKENS))
    assert specials == [1021, 1022, 1023]
    assert cfg.eos_token_ids == (tok.eos_token_id, tok.pad_token_id) == (1023, 1021)
    assert tok("hi<|im_end|>")["input_ids"][-1] == 1023
    assert len(tok) == cfg.vocab_size and max(tok.get_vocab().values()) < cfg.vocab_size


def test_qwen3_vocab_puts_special_tokens_at_qwen3_ids():
    tok = build_tokenizer(151643)
    assert [tok.token_to_id(t) for t in SPECIAL_TOKENS] == [151643, 151644, 151645]
    assert tok.get_vocab_size() == 151646
    # Filler tokens decode to text, so random models' outputs are readable.
    assert all(tok.decode([i]) for i in (300, 5000, 151642))


def test_tiny_greedy_generation_is_diverse_and_logits_are_sane(tiny):
    model = hf_model(tiny)
    fractions = greedy_distinct_fractions(model, vocab_size=1021)
    assert min(fractions) >= 0.5, fractions
    prompt = torch.arange(40).unsqueeze(0) * 7
    with torch.no_grad():
        logits = model(prompt).logits[0]
    assert torch.isfinite(logits).all()
    top2 = logits.topk(2, dim=-1).values
    margin = (top2[:, 0] - top2[:, 1]).median().item()
    assert 2.0 < logits.std(dim=-1).mean().item() < 8.0
    assert 0.01 < margin < 5.0  # a real competition between candidates, not a landslide


@pytest.mark.parametrize(
    "overrides",
    [
        {"num_key_value_heads": 4, "head_dim": 128, "tie_word_embeddings": False, "num_hidden_layers": 3},
        {"num_key_value_heads": 1, "head_dim": 32, "attention_bias": True, "vocab_size": 512},
    ],
)
def test_overridden_shapes_load_and_stay_diverse(tmp_path, overrides):
    path = make_model(tmp_path, preset="tiny", overrides=overrides)
    cfg = ModelConfig.from_pretrained(path)
    assert {k: getattr(cfg, k) for k in overrides} == overrides
    model = assert_hf_loads_same_tensors(path)
    assert min(greedy_distinct_fractions(model, cfg.vocab_size - 3, n_prompts=2)) >= 0.5


def test_same_seed_same_weights_other_seed_other_weights(tmp_path, tiny):
    again = dict(iter_safetensors(make_model(tmp_path / "again", seed=0)))
    other = dict(iter_safetensors(make_model(tmp_path / "other", seed=1)))
    first = dict(iter_safetensors(tiny))
    assert all(torch.equal(first[k], again[k]) for k in first)
    assert (tmp_path / "again" / "tokenizer.json").read_bytes() == (tiny / "tokenizer.json").read_bytes()
    assert not any(torch.equal(first[k], other[k]) for k in first)


def test_bfloat16_checkpoint_is_the_float32_one_rounded(tmp_path, tiny):
    bf16 = dict(iter_safetensors(make_model(tmp_path, dtype="bfloat16")))
    fp32 = dict(iter_safetensors(tiny))
    assert all(bf16[k].dtype == torch.bfloat16 and torch.equal(bf16[k], fp32[k].bfloat16()) for k in fp32)


def test_cli_main_writes_a_model_and_refuses_a_non_empty_directory(tmp_path, capsys):
    assert main([str(tmp_path / "m"), "--preset", "tiny", "--seed", "3", "--dtype", "float16"]) == 0
    assert "tiny" in capsys.readouterr().out
    assert ModelConfig.from_pretrained(tmp_path / "m").torch_dtype == "float16"
    with pytest.raises(FileExistsError, match="non-empty"):
        make_model(tmp_path / "m")
    with pytest.raises(SystemExit) as refused:  # from the command line: one line, no traceback
        main([str(tmp_path / "m")])
    assert refused.value.code == 2 and "refusing to write a model into non-empty" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main([str(tmp_path / "x"), "--preset", "70b"])
    with pytest.raises(ValueError, match="unknown preset"):
        make_model(tmp_path / "y", preset="70b")
    with pytest.raises(ValueError, match="vocab_size 200"):
        make_model(tmp_path / "z", overrides={"vocab_size": 200})


def test_lmpool_help_lists_every_command(capsys):
    from lmpool import cli

    assert cli.main(["--help"]) == 0
    shown = capsys.readouterr().out
    assert all(f"  {name}" in shown for name in cli.COMMANDS)
    assert cli.main(["no-such-command"]) == 2 and "usage: lmpool" in capsys.readouterr().err


def test_a_broken_file_is_named_in_the_error(tmp_path, tiny):
    import shutil

    from lmpool.model.checkpoint import iter_safetensors as read

    broken = tmp_path / "broken"
    shutil.copytree(tiny, broken)
    weights = broken / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    with pytest.raises(ValueError, match="cannot read weights file .*model.safetensors"):
        list(read(broken))
    (broken / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="config.json is not valid JSON"):
        ModelConfig.from_pretrained(broken)
    (broken / "config.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match="config.json must hold a JSON object"):
        ModelConfig.from_pretrained(broken)
