"""Presence, frequency and repetition penalties as vLLM applies them: hand-made cases on the
logits, the pending token of overlapped stepping counted, and greedy decoding with penalties
equal to a reference loop over transformers' logits, serial and overlapped."""

from __future__ import annotations

import pytest
import torch
from transformers import Qwen3ForCausalLM as HFQwen3

from lmpool import LLM, SamplingParams
from lmpool.engine.penalties import apply_penalties
from lmpool.engine.sequence import Sequence

BLOCK = 16


def seq(prompt, output, **penalties) -> Sequence:
    return Sequence("r", prompt, SamplingParams(**penalties), BLOCK, output)


def test_hand_made_case():
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -0.5]])
    s = seq([0], [1, 1, 3], repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25)
    # token 0 (prompt, positive): 2 / 2; token 1 (output twice, negative): -1 * 2 - 2 * 0.5 - 0.25;
    # token 2 unseen; token 3 (output once, positive): 3 / 2 - 0.5 - 0.25; token 4 unseen.
    expected = torch.tensor([[1.0, -3.25, 0.5, 0.75, -0.5]])
    assert torch.equal(apply_penalties(logits, [s], None), expected)


def test_each_penalty_alone_and_unpenalized_rows():
    logits = torch.tensor([[1.0, -1.0, 2.0], [1.0, -1.0, 2.0], [1.0, -1.0, 2.0], [1.0, -1.0, 2.0]])
    seqs = [seq([0], [2, 2], repetition_penalty=4.0), seq([0], [2, 2], frequency_penalty=1.0),
            seq([1], [2, 2], presence_penalty=1.5), seq([0, 1], [2])]
    got = apply_penalties(logits, seqs, None)
    assert got.tolist() == [[0.25, -1.0, 0.5], [1.0, -1.0, 0.0], [1.0, -1.0, 0.5], [1.0, -1.0, 2.0]]
    # A prompt token is only ever repetition-penalized; no penalized row leaves the logits as they were.
    assert apply_penalties(logits, [seqs[3]] * 4, None) is logits


def test_the_pending_token_counts_as_output():
    s = seq([0], [1], frequency_penalty=1.0)
    s.expect_token(row=2)  # sampled by the previous step into its row 2, not read back yet
    previous = torch.tensor([4, 4, 3])
    got = apply_penalties(torch.zeros(1, 5), [s], previous)
    assert got.tolist() == [[0.0, -1.0, 0.0, -1.0, 0.0]]


def penalized_reference(hf, prompt: list[int], n: int, rep: float, freq: float, pres: float) -> list[int]:
    """Greedy tokens over transformers' logits with the penalties applied by hand, token by token."""
    tokens = list(prompt)
    for _ in range(n):
        with torch.no_grad():
            row = hf(torch.tensor([tokens])).logits[0, -1].float().tolist()
        output = tokens[len(prompt):]
        for t in set(tokens):
            row[t] = row[t] / rep if row[t] > 0 else row[t] * rep
        for t in set(output):
            row[t] -= freq * output.count(t) + pres
        tokens.append(max(range(len(row)), key=row.__getitem__))
    return tokens[len(prompt):]


@pytest.mark.parametrize("overlapped", [True, False])
def test_greedy_with_penalties_equals_the_reference(tiny_model, overlapped):
    hf = HFQwen3.from_pretrained(tiny_model, dtype=torch.float32).eval()
    prompt = list(range(300, 320))
    settings = dict(repetition_penalty=1.3, frequency_penalty=0.4, presence_penalty=0.2)
    with LLM(tiny_model, block_size=BLOCK, async_scheduling=overlapped) as llm:
        plain, penalized = llm.generate([prompt, prompt], [
            SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
            SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, **settings)])
    expected = penalized_reference(hf, prompt, 12, 1.3, 0.4, 0.2)
    assert penalized.token_ids == expected
    assert plain.token_ids != expected  # the penalties changed the output
