"""The engine computes what transformers' Qwen3 computes, on the same random weights (fp32, CPU)."""

from __future__ import annotations

import pytest
import torch
from transformers import Qwen3ForCausalLM as HFQwen3

from lmpool import LLM, SamplingParams
from lmpool.engine.scheduler import ScheduledBatch
from lmpool.engine.sequence import Sequence
from lmpool.model.make_model import make_model
from lmpool.model.rope import YarnScaling

BLOCK = 16
CONFIGS = {
    # GQA ratio 1, head_dim 64, tied embeddings
    "mha-d64-tied": dict(num_attention_heads=4, num_key_value_heads=4, head_dim=64, tie_word_embeddings=True),
    # GQA ratio 4, head_dim 128, untied embeddings
    "gqa4-d128-untied": dict(num_attention_heads=8, num_key_value_heads=2, head_dim=128, tie_word_embeddings=False),
    # GQA ratio 2, head_dim 128, tied, three layers, a different rope_theta
    "gqa2-d128-tied": dict(
        num_attention_heads=4, num_key_value_heads=2, head_dim=128, num_hidden_layers=3, rope_theta=10000.0
    ),
    # YaRN past a short original context: prompts and outputs reach 3x its 32 positions
    "gqa2-d64-yarn": dict(
        num_attention_heads=4, num_key_value_heads=2, head_dim=64, rope_theta=10000.0,
        rope_scaling=YarnScaling(factor=4.0, original_max_position_embeddings=32),
    ),
}
# Mixed lengths that start, end and cross block boundaries.
PROMPT_LENS = (1, 7, 15, 16, 17, 33, 48, 70)


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def model_dir(request, tmp_path_factory) -> str:
    out = tmp_path_factory.mktemp(request.param) / "model"
    return str(make_model(out, preset="tiny", seed=len(request.param), overrides=CONFIGS[request.param]))


def random_prompts(vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in PROMPT_LENS]


def test_greedy_tokens_and_prefill_logits_equal_transformers(model_dir):
    hf = HFQwen3.from_pretrained(model_dir, dtype=torch.float32).eval()
    llm = LLM(model_dir, block_size=BLOCK)
    prompts = random_prompts(hf.config.vocab_size)
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    outs = llm.generate(prompts, params)
    distinct = set()
    for prompt, out in zip(prompts, outs):
        with torch.no_grad():
            ref = hf.generate(
                torch.tensor([prompt]), max_new_tokens=32, do_sample=False,
                eos_token_id=None, pad_token_id=0,
            )[0, len(prompt):].tolist()
        assert out.token_ids == ref
        distinct.update(out.token_ids)
    assert len(distinct) > 32, "random weights must give diverse greedy outputs to prove anything"

    # Prefill logits of every prompt position, through the engine's own runner.
    runner = llm.engine.runner
    bm = llm.engine.block_manager
    seqs = [Sequence(f"p{i}", p, params, BLOCK) for i, p in enumerate(prompts)]
    for s in seqs:
        bm.admit(s, [])
        bm.grow(s, len(s))
    batch = ScheduledBatch(seqs=seqs, num_tokens=[len(s) for s in seqs])
    inputs = runner.prepare(batch)
    with torch.inference_mode():
        logits = runner.model.compute_logits(runner.forward_hidden(inputs))
    start = 0
    for prompt in prompts:
        with torch.no_grad():
            ref = hf(torch.tensor([prompt])).logits[0].float()
        got = logits[start : start + len(prompt)]
        start += len(prompt)
        rel = (got - ref).norm() / ref.norm()
        assert rel < 1e-4, f"prefill logits relative error {rel:.2e}"
    for s in seqs:
        bm.free(s)
