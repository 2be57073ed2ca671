"""Offline random-weight Qwen3 checkpoints with real shapes, for tests and demos.

Owns the presets and everything ``lmpool make-model DIR`` writes: ``config.json``,
``generation_config.json``, the weights (``model.safetensors``, or 2 GB shards plus an
index) and a byte-level BPE tokenizer that transformers loads without a network, with
Qwen3's ChatML chat template.

Invariants:
- the same (preset, seed, dtype, overrides) always produces the same files.
- the weights are not the default 0.02-std init, under which a random Qwen3 repeats one
  token forever; they are scaled so greedy decoding emits varied tokens, logits have a
  standard deviation of about ``LOGIT_STD`` (so top-1 margins are neither ties nor
  astronomically large) and the residual stream stays O(1) at any depth.
- the tokenizer has exactly ``min(151643, vocab_size - 3)`` regular tokens followed by
  the special tokens, so with Qwen3's vocabulary the special ids are Qwen3's own
  (151643 ``<|endoftext|>``, 151644 ``<|im_start|>``, 151645 ``<|im_end|>``) and every
  tokenizer id is below ``vocab_size``. EOS/BOS ids in the configs follow the tokenizer.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
from collections.abc import Iterator
from pathlib import Path

import torch
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

from lmpool.model.checkpoint import save_safetensors
from lmpool.model.config import ModelConfig

_QWEN3_SHARED = dict(
    vocab_size=151936,
    num_hidden_layers=28,
    num_attention_heads=16,
    num_key_value_heads=8,
    head_dim=128,
    rms_norm_eps=1e-6,
    rope_theta=1000000.0,
    max_position_embeddings=40960,
    tie_word_embeddings=True,
)
PRESETS: dict[str, dict] = {
    # Small enough that a CPU forward takes milliseconds; head_dim * heads != hidden_size
    # on purpose, as in the real models.
    "tiny": dict(
        vocab_size=1024,
        hidden_size=128,
        intermediate_size=384,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        rms_norm_eps=1e-6,
        rope_theta=1000000.0,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
    ),
    "0.6b": dict(_QWEN3_SHARED, hidden_size=1024, intermediate_size=3072),
    "1.7b": dict(_QWEN3_SHARED, hidden_size=2048, intermediate_size=6144),
}
DEFAULT_DTYPE = {"tiny": "float32", "0.6b": "bfloat16", "1.7b": "bfloat16"}
MAX_SHARD_BYTES = 2 * 10**9

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
# Qwen3's chat format (ChatML) without its tool and thinking branches: enough for
# ``chat()`` on a generated model to build the prompts a real checkpoint's template would.
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# Qwen3's tokenizer has this many regular tokens; its special tokens start here.
_QWEN3_REGULAR_TOKENS = 151643

LOGIT_STD = 4.0
_EMBED_STD = 0.02
# q_norm/k_norm weights of 3 make attention scores' std about 9: attention is sharp, so
# each step's output depends on specific earlier tokens instead of a context average
# that barely moves, which is what drives a random model into loops.
_QK_NORM_GAIN = 3.0
_NORM_NOISE = 0.1

_CORPUS = """\
The harbour town woke slowly on winter mornings. Fishing boats came back before dawn,
their decks shining with ice and salt, and the first bakers opened their doors while the
streets were still dark. Children ran down to the water to count the gulls, and old men
argued about the weather as if it could be persuaded to change its mind.

A library is a quiet machine for remembering. Every book on its shelves was written by
someone who wanted a stranger to understand something, and every reader who opens one
agrees, for a while, to listen. The catalogue tells you where a book lives; it cannot
tell you which one will change the way you think.

Engineers like to say that a system is only as fast as its slowest part. When a program
waits for the disk, the network or another process, adding more processors does not
help. The useful question is always the same: where does the time go, and what would
happen if we removed that cost entirely?

In the mountains the weather changes faster than any forecast. A clear blue sky at noon
can become a storm of hail and thunder within an hour, so experienced walkers carry warm
clothes, water and a map even on the brightest summer days. They also know when to turn
around, which is the hardest skill of all.

Good soup begins with patience. Onions should soften slowly in butter until they are
sweet, then the vegetables go in, then the stock, and only at the end the herbs and a
little salt. People who hurry the first step usually wonder later why the flavour never
came together.

The history of numbers is a history of people trying to count things that mattered to
them: sheep, days, coins, stars. Zero arrived late and was treated with suspicion for
centuries, because it seemed strange to write down a symbol for nothing at all. Today
every computer depends on it.

She opened the window and listened. Somewhere below, a train was crossing the river, and
its long low whistle moved through the valley like a question nobody answered. The
letter on the table could wait until morning; some decisions are easier after sleep.

Questions and answers travel together. What is the time? It is half past seven. Where
are you going? To the market, then home. Why are the lights still on? Because the meeting
ran late again, and nobody remembered to switch them off before leaving the building.
"""


def make_model(
    out_dir: str | Path,
    preset: str = "tiny",
    seed: int = 0,
    dtype: str | None = None,
    overrides: dict | None = None,
) -> Path:
    """Write a random-weight Qwen3 checkpoint with ``preset``'s shapes into ``out_dir``.

    ``dtype`` defaults to float32 for "tiny" and bfloat16 for the real presets.
    ``overrides`` replaces ``ModelConfig`` fields of the preset (e.g.
    ``{"num_key_value_heads": 4, "tie_word_embeddings": False}``); the token ids are
    always the tokenizer's.
    """
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose one of {sorted(PRESETS)}")
    out = Path(out_dir)
    if out.exists() and any(out.iterdir()):
        raise FileExistsError(f"refusing to write a model into non-empty directory {out}")
    fields = {**PRESETS[preset], "torch_dtype": dtype or DEFAULT_DTYPE[preset], **(overrides or {})}
    vocab_size = fields["vocab_size"]
    regular = min(_QWEN3_REGULAR_TOKENS, vocab_size - len(SPECIAL_TOKENS))
    if regular < 256:
        raise ValueError(f"vocab_size {vocab_size} cannot hold 256 byte tokens + specials")
    endoftext, _, im_end = range(regular, regular + len(SPECIAL_TOKENS))
    # Qwen3's layout: config EOS <|im_end|> plus <|endoftext|>, BOS <|endoftext|>.
    cfg = ModelConfig(**fields, eos_token_ids=(im_end, endoftext), bos_token_id=endoftext)

    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(cfg.to_hf_dict(), indent=2) + "\n")
    generation = {"bos_token_id": endoftext, "eos_token_id": [im_end, endoftext], "pad_token_id": endoftext}
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    _save_tokenizer(build_tokenizer(regular), out, cfg.max_position_embeddings)
    weight_bytes = _num_params(cfg) * getattr(torch, cfg.torch_dtype).itemsize
    shard = MAX_SHARD_BYTES if weight_bytes > MAX_SHARD_BYTES else None
    save_safetensors(random_weights(cfg, seed), out, max_shard_bytes=shard)
    return out


def random_weights(cfg: ModelConfig, seed: int) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield HF-named Qwen3 weights one tensor at a time (memory stays at one tensor).

    Each tensor is drawn in float32 from one seeded generator, in a fixed order, then
    cast; so checkpoints of different dtypes from one seed are the same model rounded.
    Linear weights have std 1/sqrt(fan_in) (unit-variance outputs); o_proj and down_proj
    are further shrunk by sqrt(2 * layers) so the 2 * layers residual branches sum to
    O(1). Embeddings are small (0.02) next to those branches: with tied embeddings the
    logit of token t is proportional to embed[t] . h, and a residual stream dominated by
    the input embedding would make every token predict itself. The final norm's gain
    sets the logit std to LOGIT_STD.
    """
    gen = torch.Generator().manual_seed(seed)
    dtype = getattr(torch, cfg.torch_dtype)
    branch_scale = 1.0 / math.sqrt(2 * cfg.num_hidden_layers)

    def normal(shape: tuple[int, ...], std: float, mean: float = 0.0) -> torch.Tensor:
        t = torch.randn(shape, generator=gen, dtype=torch.float32).mul_(std).add_(mean)
        return t.to(dtype)

    def linear(out_f: int, in_f: int, scale: float = 1.0) -> torch.Tensor:
        return normal((out_f, in_f), scale / math.sqrt(in_f))

    def norm(size: int, gain: float = 1.0) -> torch.Tensor:
        return normal((size,), gain * _NORM_NOISE, mean=gain)

    d, hd, inter = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    q_out, kv_out = cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd
    yield "model.embed_tokens.weight", normal((cfg.vocab_size, d), _EMBED_STD)
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        yield p + "input_layernorm.weight", norm(d)
        yield p + "self_attn.q_proj.weight", linear(q_out, d)
        yield p + "self_attn.k_proj.weight", linear(kv_out, d)
        yield p + "self_attn.v_proj.weight", linear(kv_out, d)
        yield p + "self_attn.o_proj.weight", linear(d, q_out, branch_scale)
        if cfg.attention_bias:
            # Non-zero (10% of each output's scale) so a loader that drops biases fails.
            yield p + "self_attn.q_proj.bias", normal((q_out,), 0.1)
            yield p + "self_attn.k_proj.bias", normal((kv_out,), 0.1)
            yield p + "self_attn.v_proj.bias", normal((kv_out,), 0.1)
            yield p + "self_attn.o_proj.bias", normal((d,), 0.1 * branch_scale)
        yield p + "self_attn.q_norm.weight", norm(hd, _QK_NORM_GAIN)
        yield p + "self_attn.k_norm.weight", norm(hd, _QK_NORM_GAIN)
        yield p + "post_attention_layernorm.weight", norm(d)
        yield p + "mlp.gate_proj.weight", linear(inter, d)
        yield p + "mlp.up_proj.weight", linear(inter, d)
        yield p + "mlp.down_proj.weight", linear(d, inter, branch_scale)
    # The normed hidden state has RMS 1, so logits = gain * sqrt(d) * _EMBED_STD * N(0, 1).
    yield "model.norm.weight", norm(d, LOGIT_STD / (math.sqrt(d) * _EMBED_STD))
    if not cfg.tie_word_embeddings:
        yield "lm_head.weight", normal((cfg.vocab_size, d), _EMBED_STD)


def _num_params(cfg: ModelConfig) -> int:
    d, hd = cfg.hidden_size, cfg.head_dim
    attn = d * hd * (2 * cfg.num_attention_heads + 2 * cfg.num_key_value_heads) + 2 * hd
    if cfg.attention_bias:
        attn += hd * (cfg.num_attention_heads + 2 * cfg.num_key_value_heads) + d
    layer = attn + 3 * d * cfg.intermediate_size + 2 * d
    heads = 1 if cfg.tie_word_embeddings else 2
    return cfg.num_hidden_layers * layer + heads * cfg.vocab_size * d + d


def build_tokenizer(regular_tokens: int) -> Tokenizer:
    """A byte-level BPE with exactly ``regular_tokens`` regular tokens, then SPECIAL_TOKENS.

    Merges are learned from the built-in corpus, which supports under a thousand tokens;
    the rest are filler merges (concatenations of learned tokens, in a fixed order), so
    that every id a random model emits decodes to readable text.
    """
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=regular_tokens,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_CORPUS.split("\n\n"), trainer)
    model = json.loads(tokenizer.to_str())["model"]
    vocab: dict[str, int] = model["vocab"]
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in model["merges"]]

    learned = sorted(vocab, key=vocab.__getitem__)

    def body(token: str) -> str:  # "Ġ" is how byte-level BPE spells a leading space
        return token[1:] if token.startswith("Ġ") else token

    # Word-like fillers first, then any printable pair; no fillers from control bytes or
    # partial UTF-8, which would decode to garbage.
    starts = [t for t in learned if t.startswith("Ġ") and body(t).isascii() and body(t).isalpha()]
    continuations = [t for t in learned if t.isascii() and t.isalpha()]
    printable = [t for t in learned if body(t).isascii() and body(t).isprintable() and body(t)]
    candidates = itertools.chain(
        itertools.product(starts, continuations), itertools.product(printable, printable)
    )
    for left, right in candidates:
        if len(vocab) >= regular_tokens:
            break
        if left + right not in vocab:
            vocab[left + right] = len(vocab)
            merges.append((left, right))

    tokenizer.model = models.BPE(vocab=vocab, merges=merges)
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    return tokenizer


def _save_tokenizer(tokenizer: Tokenizer, out: Path, max_length: int) -> None:
    # Written by hand rather than with transformers' save_pretrained, whose
    # tokenizer_class differs between transformers 4 and 5; PreTrainedTokenizerFast over
    # tokenizer.json loads in both. Decoding must not "clean up" spaces, or decode(encode(s))
    # would differ from s.
    tokenizer.save(str(out / "tokenizer.json"))
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "model_max_length": max_length,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="lmpool make-model",
        description="Write a random-weight Qwen3 checkpoint (config, weights, tokenizer).",
    )
    parser.add_argument("dir", type=Path, help="output directory (must be empty or absent)")
    parser.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--dtype", choices=["float32", "float16", "bfloat16"], default=None,
        help="weight dtype (default: float32 for tiny, bfloat16 otherwise)",
    )
    args = parser.parse_args(argv)
    try:
        out = make_model(args.dir, preset=args.preset, seed=args.seed, dtype=args.dtype)
    except (FileExistsError, NotADirectoryError, PermissionError) as e:
        parser.error(str(e))  # one line and exit status 2, as for any bad argument
    cfg = ModelConfig.from_pretrained(out)
    print(f"wrote {args.preset} ({_num_params(cfg) / 1e6:.1f}M params, {cfg.torch_dtype}) to {out}")
    return 0
