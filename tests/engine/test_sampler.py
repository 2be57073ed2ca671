"""Sampler and the runner's greedy path: the same tokens as before they stopped syncing the host.

``FormerSampler`` is the sampler as it was when every small vector went to the
device with a synchronous copy; the current one must draw exactly the same
tokens from the same seeds, call after call, so seeded requests stay
reproducible across versions. The runner's greedy path (argmax of model-dtype
logits) must equal the sampler's argmax of their fp32 cast, ties included.
"""

from __future__ import annotations

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import given, settings

from lmpool import LLM
from lmpool.engine.sampler import Sampler, _apply_top_k, _apply_top_p
from lmpool.engine.sequence import Sequence
from lmpool.sampling_params import SamplingParams

VOCAB = 40


class FormerSampler(Sampler):
    def __call__(self, logits, params, request_ids):
        greedy = logits.argmax(dim=-1)
        sampled_rows = [i for i, p in enumerate(params) if not p.greedy]
        if not sampled_rows:
            return greedy.tolist()
        rows = torch.tensor(sampled_rows, device=logits.device)
        sub = logits[rows]
        temps = torch.tensor([params[i].temperature for i in sampled_rows], device=logits.device)
        sub = sub / temps.unsqueeze(1)
        sub = _apply_top_k(sub, [params[i].top_k for i in sampled_rows])
        sub = _apply_top_p(sub, [params[i].top_p for i in sampled_rows])
        probs = torch.softmax(sub, dim=-1)
        noise = torch.empty_like(probs)
        unseeded = []
        for j, i in enumerate(sampled_rows):
            if params[i].seed is None:
                unseeded.append(j)
            else:
                noise[j].exponential_(generator=self._generator(request_ids[i], params[i].seed))
        if unseeded:
            idx = torch.tensor(unseeded, device=logits.device)
            noise[idx] = torch.empty(len(unseeded), probs.shape[1], device=logits.device).exponential_(
                generator=self.generator
            )
        choice = (probs / noise).argmax(dim=-1)
        out = greedy.clone()
        out[rows] = choice
        return out.tolist()


params_st = st.builds(
    SamplingParams,
    temperature=st.sampled_from([0.0, 0.5, 1.0, 1.7]),
    top_p=st.sampled_from([1.0, 0.9, 0.3, 1e-6]),
    top_k=st.sampled_from([-1, 0, 1, 5, VOCAB, VOCAB + 3]),
    seed=st.one_of(st.none(), st.integers(0, 3)),
)


@settings(max_examples=40, deadline=None)
@given(
    steps=st.lists(st.lists(st.tuples(st.integers(0, 5), params_st), min_size=1, max_size=6), min_size=1, max_size=4),
    seed=st.integers(0, 2**16),
)
def test_sample_draws_what_the_former_sampler_drew(steps, seed):
    new, old = Sampler(torch.device("cpu"), seed), FormerSampler(torch.device("cpu"), seed)
    g = torch.Generator().manual_seed(seed)
    for rows in steps:
        logits = torch.randn(len(rows), VOCAB, generator=g) * 3
        ids = [f"r{rid}" for rid, _ in rows]  # a request id may recur: its generator carries on
        params = [p for _, p in rows]
        got = new.sample(logits, params, ids)
        assert got.dtype == torch.int64 and got.shape == (len(rows),)
        assert got.tolist() == old(logits, params, ids)


def test_call_returns_the_sampled_list():
    sampler = Sampler(torch.device("cpu"), 0)
    logits = torch.tensor([[0.0, 3.0, 1.0], [2.0, 0.0, 0.0]])
    assert sampler(logits, [SamplingParams(temperature=0)] * 2, ["a", "b"]) == [1, 0]


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_greedy_path_equals_sampler_argmax_ties_included(tiny_model, dtype):
    llm = LLM(tiny_model, dtype=dtype, block_size=16)
    runner = llm.engine.runner
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(9, runner.model_config.hidden_size, generator=g).to(runner.dtype)
    hidden[3] = 0  # every logit 0: a tie across the whole vocabulary
    hidden[5] = hidden[4]
    greedy = SamplingParams(temperature=0)
    seqs = [Sequence(f"g{i}", [1], greedy, 16) for i in range(len(hidden))]
    with torch.inference_mode():
        fast = runner.sample(hidden, seqs)
        ref = runner.sampler(runner.model.compute_logits(hidden), [greedy] * len(seqs), [s.request_id for s in seqs])
    assert fast.tolist() == ref
    assert ref[3] == 0
    assert runner.model.compute_logits(hidden, fp32=False).dtype == runner.dtype
    llm.shutdown()
