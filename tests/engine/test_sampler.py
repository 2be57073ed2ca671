"""The sampler against the exact distribution, and the runner's greedy path.

Each sampling setting's distribution is computed here from the definitions, in float64
numpy, without the sampler's helpers: ``softmax(logits / temperature)``, cut to the
``top_k`` most likely tokens, then to the nucleus (the fewest most likely tokens whose
mass reaches ``top_p``), renormalised. The sampler draws ``N`` tokens from one batch of
``N`` identical rows with a fixed seed, so every run draws the same tokens.

Tolerance: a token of exact probability ``p`` is drawn ``Binomial(N, p)`` times; its count
must lie within ``SIGMAS`` standard deviations ``sqrt(N p (1 - p))`` of ``N p``. For a correct
sampler each check fails with probability about 6e-7, so under 1e-4 over every token of every
case: the fixed seed was not picked to pass. With ``N = 40,000`` a probability off by more
than ``5 * 0.5 / 200 = 0.0125`` fails, and the settings below move some token's probability
by far more than that when temperature, top-k or top-p is skipped, misplaced or off by a
token. A token of probability 0 (outside top-k or the nucleus) must never be drawn: exact.

The runner's greedy path (argmax of model-dtype logits) must equal the sampler's argmax of
their fp32 cast, ties included.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from lmpool import LLM
from lmpool.engine.sampler import Sampler
from lmpool.engine.sequence import Sequence
from lmpool.sampling_params import SamplingParams

N = 40_000
SIGMAS = 5.0
SEED = 1234
# Distinct logits (no ties, so top-k and the nucleus are unambiguous), not in sorted order,
# so a sampler that confused sorted positions with token ids would draw the wrong tokens.
LOGITS = np.array([0.4, 2.0, -1.6, 1.1, -0.3, 1.5, -2.5, 0.0, 0.7, -0.9])
VOCAB = len(LOGITS)


def exact_distribution(logits: np.ndarray, temperature: float, top_k: int = -1, top_p: float = 1.0) -> np.ndarray:
    """The distribution a sampled request's settings define, in float64."""
    z = logits.astype(np.float64) / temperature
    probs = np.exp(z - z.max())
    probs /= probs.sum()
    by_likelihood = np.argsort(-z)
    if 0 < top_k < len(z):  # top_k <= 0 or >= the vocabulary keeps every token
        probs[by_likelihood[top_k:]] = 0.0
        probs /= probs.sum()
    if top_p < 1.0:
        mass = np.cumsum(probs[by_likelihood])
        size = int(np.searchsorted(mass, top_p)) + 1  # the first prefix whose mass reaches top_p
        probs[by_likelihood[size:]] = 0.0
        probs /= probs.sum()
    return probs


def draw(params: SamplingParams, n: int = N) -> np.ndarray:
    """How often each token is drawn in ``n`` rows of ``LOGITS`` under ``params`` (unseeded)."""
    sampler = Sampler(torch.device("cpu"), SEED)
    logits = torch.tensor(LOGITS, dtype=torch.float32).repeat(n, 1)
    tokens = sampler.sample(logits, [params] * n, [f"r{i}" for i in range(n)])
    assert tokens.dtype == torch.int64 and tokens.shape == (n,)
    return np.bincount(tokens.numpy(), minlength=VOCAB)


def assert_follows(counts: np.ndarray, probs: np.ndarray) -> None:
    n = counts.sum()
    drawn_outside = [t for t in range(VOCAB) if probs[t] == 0 and counts[t]]
    assert not drawn_outside, f"tokens {drawn_outside} of probability 0 drawn: counts {counts.tolist()}"
    bound = SIGMAS * np.sqrt(n * probs * (1 - probs))
    off = [(t, int(counts[t]), round(n * probs[t], 1), round(bound[t], 1))
           for t in range(VOCAB) if abs(counts[t] - n * probs[t]) > bound[t]]
    assert not off, f"(token, count, expected, bound) beyond {SIGMAS} sigmas: {off}"


# Each case's settings change the distribution: the nucleus and top-k cut different numbers
# of tokens at different temperatures, so applying top-p before the temperature, or top-k
# after top-p, gives another support or other probabilities.
CASES = {
    "plain": dict(temperature=1.0),
    "cold": dict(temperature=0.5),
    "hot": dict(temperature=1.7),
    "top_k": dict(temperature=1.0, top_k=4),
    "top_k_off": dict(temperature=1.3, top_k=VOCAB + 3),  # past the vocabulary: no cut
    "top_k_zero": dict(temperature=1.3, top_k=0),  # disabled
    "top_p": dict(temperature=1.0, top_p=0.8),
    "top_p_cold": dict(temperature=0.6, top_p=0.8),
    "top_p_hot": dict(temperature=2.0, top_p=0.6),
    "top_k_and_top_p": dict(temperature=1.4, top_k=5, top_p=0.7),
    # the nucleus of the top-k renormalised: two tokens (of the full distribution, three)
    "top_p_after_top_k": dict(temperature=0.8, top_k=3, top_p=0.8),
}


def test_the_cases_are_not_on_a_knife_edge():
    """No nucleus boundary lies within float32 rounding of ``top_p`` (the sampler works in
    float32), and each filter cuts something, so each case shows what it sets."""
    for name, case in CASES.items():
        full = exact_distribution(LOGITS, case["temperature"])
        if case.get("top_p", 1.0) < 1.0:
            before_p = exact_distribution(LOGITS, case["temperature"], case.get("top_k", -1))
            mass = np.cumsum(np.sort(before_p)[::-1])
            assert np.abs(mass - case["top_p"]).min() > 1e-3, name
        probs = exact_distribution(LOGITS, **case)
        if 0 < case.get("top_k", -1) < VOCAB or case.get("top_p", 1.0) < 1.0:
            assert (probs == 0).sum() > 0 and (full == 0).sum() == 0, name


@pytest.mark.parametrize("name", CASES)
def test_sampled_tokens_follow_the_exact_distribution(name):
    case = CASES[name]
    assert_follows(draw(SamplingParams(**case)), exact_distribution(LOGITS, **case))


def test_tokens_outside_top_k_and_the_nucleus_are_never_drawn():
    """Exact, not statistical: the support is exactly the kept tokens, each drawn."""
    order = np.argsort(-LOGITS)
    top = exact_distribution(LOGITS, 1.0)[order]
    assert top[:2].sum() < 0.65 < top[:3].sum()  # at T=1 the nucleus of 0.65 is three tokens
    for params, kept in [
        (SamplingParams(temperature=1.5, top_k=3), order[:3]),
        (SamplingParams(temperature=1.0, top_p=0.65), order[:3]),
        (SamplingParams(temperature=1.0, top_k=2, top_p=0.99), order[:2]),
    ]:
        counts = draw(params, 20_000)
        assert set(np.flatnonzero(counts).tolist()) == set(kept.tolist()), (params, counts.tolist())


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0),
    SamplingParams(temperature=2.0, top_k=1),
    SamplingParams(temperature=2.0, top_p=1e-6),
], ids=["temperature_0", "top_k_1", "tiny_top_p"])
def test_greedy_settings_always_draw_the_argmax(params):
    counts = draw(params, 2_000)
    assert counts[np.argmax(LOGITS)] == 2_000


def test_greedy_rows_beside_sampled_rows_stay_argmax():
    sampler = Sampler(torch.device("cpu"), SEED)
    g = torch.Generator().manual_seed(SEED)
    logits = torch.randn(64, VOCAB, generator=g) * 3
    greedy, hot = SamplingParams(temperature=0), SamplingParams(temperature=5.0)
    params = [greedy if i % 2 else hot for i in range(64)]
    tokens = sampler.sample(logits, params, [f"r{i}" for i in range(64)])
    assert tokens[1::2].tolist() == logits[1::2].argmax(dim=-1).tolist()
    assert tokens[0::2].tolist() != logits[0::2].argmax(dim=-1).tolist(), "hot rows are sampled"


def test_seeded_requests_follow_the_exact_distribution_across_seeds():
    """Each seeded request draws from its own generator: over many seeds its first token
    follows the same distribution as unseeded ones."""
    n = 20_000
    case = CASES["top_p_hot"]
    params = [SamplingParams(**case, seed=s) for s in range(n)]
    logits = torch.tensor(LOGITS, dtype=torch.float32).repeat(n, 1)
    tokens = Sampler(torch.device("cpu"), SEED).sample(logits, params, [f"s{s}" for s in range(n)])
    assert_follows(np.bincount(tokens.numpy(), minlength=VOCAB), exact_distribution(LOGITS, **case))


def test_a_seeded_request_draws_the_same_tokens_whatever_shares_its_batch():
    g = torch.Generator().manual_seed(SEED)
    steps = [torch.randn(4, VOCAB, generator=g) * 2 for _ in range(6)]
    seeded = SamplingParams(temperature=1.0, seed=7)
    alone, crowded = Sampler(torch.device("cpu"), 0), Sampler(torch.device("cpu"), 99)
    mine, beside = [], []
    for i, logits in enumerate(steps):
        mine.append(alone.sample(logits[:1], [seeded], ["me"]).item())
        # elsewhere in the batch, among unseeded, greedy and other seeded rows
        others = [SamplingParams(temperature=1.0), SamplingParams(temperature=0), SamplingParams(seed=i)]
        batch = torch.cat([logits[1:3], logits[:1], logits[3:]])
        out = crowded.sample(batch, others[:2] + [seeded] + others[2:], ["u", "g", "me", f"o{i}"])
        beside.append(out[2].item())
    assert mine == beside
    assert len(set(mine)) > 1, "the request's generator carries on from step to step"


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
