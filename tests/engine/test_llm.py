"""LLM behaviour on the tiny model: prefix caching, preemption, chunked prefill, sampling, bad input."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from lmpool import LLM, SamplingParams

BLOCK = 16
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


def prompts(n: int = 8, seed: int = 0, vocab: int = 1000, lo: int = 5, hi: int = 80) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(lo, hi, (n,), generator=g).tolist()
    return [torch.randint(0, vocab, (k,), generator=g).tolist() for k in lens]


@pytest.fixture(scope="module")
def llm(tiny_model):
    with LLM(tiny_model, block_size=BLOCK, max_num_batched_tokens=512) as engine:
        yield engine


@pytest.fixture(scope="module")
def reference(llm):
    """Greedy outputs of a fresh, roomy engine: the tokens every other schedule must reproduce."""
    return [o.token_ids for o in llm.generate(prompts(), GREEDY)]


def test_second_run_hits_prefix_cache_with_identical_tokens(tiny_model, reference):
    with LLM(tiny_model, block_size=BLOCK) as fresh:
        first = fresh.generate(prompts(), GREEDY)
        second = fresh.generate(prompts(), GREEDY)
    assert [o.token_ids for o in first] == reference
    assert [o.token_ids for o in second] == reference
    assert all(o.num_cached_tokens == 0 for o in first)
    for p, o in zip(prompts(), second):
        complete = (len(p) - 1) // BLOCK * BLOCK  # the last prompt token is always recomputed
        assert o.num_cached_tokens == complete
    assert any(o.num_cached_tokens > 0 for o in second)


def test_preemption_recomputes_identical_tokens(tiny_model, reference):
    # 12 blocks of 16 tokens cannot hold 8 sequences of up to ~100 tokens at once.
    with LLM(tiny_model, block_size=BLOCK, num_kv_blocks=12) as small:
        outs = small.generate(prompts(), GREEDY)
        assert small.engine.scheduler.num_preemptions > 0
        small.engine.block_manager.check_invariants([])
    assert [o.token_ids for o in outs] == reference


def test_chunked_prefill_and_small_batches_give_identical_tokens(tiny_model, reference):
    with LLM(tiny_model, block_size=BLOCK, max_num_batched_tokens=7, max_num_seqs=3) as chunked:
        outs = chunked.generate(prompts(), GREEDY)
    assert [o.token_ids for o in outs] == reference


def test_without_prefix_caching_nothing_is_cached(tiny_model, reference):
    with LLM(tiny_model, block_size=BLOCK, enable_prefix_caching=False) as plain:
        plain.generate(prompts(), GREEDY)
        outs = plain.generate(prompts(), GREEDY)
    assert [o.token_ids for o in outs] == reference
    assert all(o.num_cached_tokens == 0 for o in outs)


def test_text_prompts_and_outputs(llm):
    out = llm.generate(["The harbour town woke slowly", "A library"], SamplingParams(temperature=0, max_tokens=8))
    assert len(out) == 2
    for o in out:
        assert isinstance(o.text, str)
        assert o.text == llm.tokenizer.decode(o.token_ids, skip_special_tokens=True)
        assert o.prompt_token_ids == llm.tokenizer.encode(
            "The harbour town woke slowly" if o is out[0] else "A library", add_special_tokens=False
        )


def test_numpy_and_torch_token_ids_are_prompts(llm):
    want = llm.generate([3, 4, 5], GREEDY)[0].token_ids
    for one in ([np.int64(3), np.int64(4), np.int64(5)], np.array([3, 4, 5]), torch.tensor([3, 4, 5]),
                [torch.tensor(3), torch.tensor(4), torch.tensor(5)]):
        assert [o.token_ids for o in llm.generate(one, GREEDY)] == [want]
    assert [o.token_ids for o in llm.generate(torch.tensor([[3, 4, 5], [3, 4, 5]]), GREEDY)] == [want, want]


def test_single_prompt_forms(llm):
    ids = prompts(1)[0]
    assert len(llm.generate(ids, GREEDY)) == 1
    assert llm.generate(ids, GREEDY)[0].token_ids == llm.generate([ids], GREEDY)[0].token_ids


def test_stop_conditions(llm):
    ids = prompts(1)[0]
    free_run = llm.generate(ids, GREEDY)[0].token_ids
    stop_at = free_run[5]
    out = llm.generate(ids, SamplingParams(temperature=0, max_tokens=24, stop_token_ids=[stop_at], ignore_eos=True))[0]
    assert out.finish_reason == "stop"
    assert out.token_ids == free_run[: free_run.index(stop_at) + 1]
    out = llm.generate(ids, SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 3


def test_eos_stops_unless_ignored(llm):
    eos = sorted(llm.engine.eos_token_ids)[0]
    ids = prompts(1)[0]
    free_run = llm.generate(ids, GREEDY)[0].token_ids
    # Make the model's own next token the EOS by treating it as one.
    llm.engine.eos_token_ids = frozenset({free_run[2]})
    try:
        out = llm.generate(ids, SamplingParams(temperature=0, max_tokens=24))[0]
        assert out.finish_reason == "stop" and out.token_ids == free_run[: free_run.index(free_run[2]) + 1]
        out = llm.generate(ids, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))[0]
        assert out.token_ids == free_run
    finally:
        llm.engine.eos_token_ids = frozenset({eos, *llm.engine.model_config.eos_token_ids})


def test_seeded_sampling_is_reproducible_whatever_the_batch(llm):
    ids = prompts(3)
    p = SamplingParams(temperature=1.0, top_k=50, top_p=0.9, max_tokens=16, seed=1234, ignore_eos=True)
    alone = llm.generate(ids[0], p)[0].token_ids
    batched = llm.generate(ids, [p, SamplingParams(temperature=0.7, max_tokens=5), GREEDY])[0].token_ids
    assert alone == batched
    other_seed = llm.generate(ids[0], SamplingParams(temperature=1.0, max_tokens=16, seed=99, ignore_eos=True))
    assert other_seed[0].token_ids != alone


def test_top_k_one_and_tiny_top_p_are_greedy(llm, reference):
    ids = prompts()
    for p in (
        SamplingParams(temperature=1.5, top_k=1, max_tokens=24, ignore_eos=True),
        SamplingParams(temperature=1.5, top_p=1e-6, max_tokens=24, ignore_eos=True),
    ):
        assert [o.token_ids for o in llm.generate(ids, p)] == reference


def test_sampling_follows_the_distribution():
    """The exponential race draws from softmax(logits / T): empirical frequencies match."""
    from lmpool.engine.sampler import Sampler

    sampler = Sampler(torch.device("cpu"), seed=0)
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]]).repeat(4000, 1)
    p = SamplingParams(temperature=1.0, max_tokens=1)
    tokens = torch.tensor(sampler(logits, [p] * 4000, [f"r{i}" for i in range(4000)]))
    freq = torch.bincount(tokens, minlength=4).float() / 4000
    expected = torch.softmax(logits[0], dim=0)
    assert (freq - expected).abs().max() < 0.03  # ~5 standard errors
    top2 = SamplingParams(temperature=1.0, top_k=2, max_tokens=1)
    tokens = torch.tensor(sampler(logits, [top2] * 4000, [f"k{i}" for i in range(4000)]))
    assert set(tokens.tolist()) == {0, 1}


# ---- bad input: a clear ValueError, and the engine keeps serving ------------------------


@pytest.mark.parametrize(
    "make_params, match",
    [
        (lambda: SamplingParams(max_tokens=0), "max_tokens"),
        (lambda: SamplingParams(temperature=-0.5), "temperature"),
        (lambda: SamplingParams(top_p=0.0), "top_p"),
        (lambda: SamplingParams(top_p=1.5), "top_p"),
        (lambda: SamplingParams(max_tokens=True), "max_tokens must be an integer"),
        (lambda: SamplingParams(temperature=float("inf")), "temperature must be a finite number"),
        (lambda: SamplingParams(seed="abc"), "seed must be an integer"),
        (lambda: SamplingParams(seed=1.5), "seed must be an integer"),
        (lambda: SamplingParams(seed=2**70), r"seed must lie in \[-2\*\*63, 2\*\*64\)"),
        (lambda: SamplingParams(stop_token_ids=[-1]), "stop token ids must be >= 0"),
        (lambda: SamplingParams(stop_token_ids="12"), "stop_token_ids must be a sequence"),
    ],
)
def test_bad_sampling_params(make_params, match):
    with pytest.raises(ValueError, match=match):
        make_params()


@pytest.mark.parametrize(
    "prompt, params, match",
    [
        ([], GREEDY, "empty"),
        ("", GREEDY, "empty"),
        ([1, 2, 10**6], GREEDY, "outside the vocabulary"),
        ([1, -3], GREEDY, "outside the vocabulary"),
        ([1] * 10, SamplingParams(max_tokens=5000), "exceeds max_model_len"),
        ([1.0, 2.0], GREEDY, "is not an integer token id"),
        ([1, 2], SamplingParams(stop_token_ids=[10**6]), "stop token id 1000000 is outside the vocabulary"),
        ([1, 2], {"max_tokens": 4}, "sampling params must be SamplingParams, got dict"),
    ],
)
def test_bad_prompt_is_refused_and_engine_keeps_serving(llm, reference, prompt, params, match):
    with pytest.raises(ValueError, match=match):
        llm.generate([prompts()[0], prompt], [GREEDY, params])
    assert not llm.engine.has_unfinished(), "a refused batch must not leave requests behind"
    assert [o.token_ids for o in llm.generate(prompts(), GREEDY)] == reference


def test_request_that_never_fits_is_refused(tiny_model):
    with LLM(tiny_model, block_size=BLOCK, num_kv_blocks=4) as small:
        with pytest.raises(ValueError, match="could never run"):
            small.generate([1] * 60, SamplingParams(max_tokens=10))
        assert len(small.generate([1] * 20, SamplingParams(max_tokens=4))[0].token_ids) == 4


def test_bad_request_mid_flight_does_not_disturb_running_ones(llm, reference):
    engine = llm.engine
    for i, p in enumerate(prompts()):
        engine.add_request(f"mid-{i}", p, GREEDY)
    engine.step()
    with pytest.raises(ValueError, match="outside the vocabulary"):
        engine.add_request("mid-bad", [10**9], GREEDY)
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("mid-0", [1, 2], GREEDY)
    assert engine.abort_request("no-such-request") is False
    done = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.seq.output_token_ids
    assert [done[f"mid-{i}"] for i in range(len(reference))] == reference


def test_abort_frees_blocks(llm):
    engine = llm.engine
    engine.add_request("to-abort", prompts(1)[0], GREEDY)
    engine.step()
    assert engine.block_manager.num_used > 0
    assert engine.abort_request("to-abort") is True
    assert engine.block_manager.num_used == 0
    assert not engine.has_unfinished()


def test_bad_engine_arguments(tiny_model, tmp_path):
    with pytest.raises(ValueError, match="device"):
        LLM(tiny_model, device="tpu")
    with pytest.raises(ValueError, match="block_size"):
        LLM(tiny_model, block_size=24)
    with pytest.raises(FileNotFoundError):
        LLM(str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="max_model_len"):
        LLM(tiny_model, max_model_len=10**7)
    for bad in (0, -5, 2.5):
        with pytest.raises(ValueError, match="max_model_len must be an integer >= 1"):
            LLM(tiny_model, max_model_len=bad)


def test_flash_prefill_on_an_engine_without_the_kernels_says_it_is_ignored(tiny_model):
    with pytest.warns(RuntimeWarning, match="prefill_attention 'flash' needs LMPool's CUDA kernels"):
        llm = LLM(tiny_model, block_size=256, prefill_attention="flash")
    assert llm.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=2))[0].token_ids
    llm.shutdown()
