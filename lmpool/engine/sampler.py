"""Turns a batch of logits into next tokens: greedy, temperature, top-k, top-p, per-request seeds.

Sampling uses the exponential race (``argmax(p / E)`` with ``E ~ Exp(1)``), which
draws from ``p`` exactly and needs one noise vector per row; a seeded request
draws its noise from its own generator, so its tokens do not depend on what
else shares the batch.

``sample`` never synchronises with the host: the small per-row vectors it needs
(row indices, temperatures, top-k, top-p) go to the device from pinned memory
with ``non_blocking`` copies, and the tokens stay on the device for the caller
to read back once. The random draws (their order, shapes and generators) are
the same whatever path a batch takes, so seeded requests are reproducible.
"""

from __future__ import annotations

import torch

from lmpool.sampling_params import SamplingParams


class Sampler:
    def __init__(self, device: torch.device, seed: int = 0) -> None:
        self.device = device
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)
        self._request_generators: dict[str, torch.Generator] = {}

    def release(self, request_id: str) -> None:
        self._request_generators.pop(request_id, None)

    def _generator(self, request_id: str, seed: int) -> torch.Generator:
        gen = self._request_generators.get(request_id)
        if gen is None:
            gen = torch.Generator(device=self.device)
            gen.manual_seed(seed)
            self._request_generators[request_id] = gen
        return gen

    def __call__(
        self, logits: torch.Tensor, params: list[SamplingParams], request_ids: list[str]
    ) -> list[int]:
        """One token per row of ``logits[B, vocab]`` (fp32)."""
        return self.sample(logits, params, request_ids).tolist()

    def sample(
        self, logits: torch.Tensor, params: list[SamplingParams], request_ids: list[str]
    ) -> torch.Tensor:
        """One token per row of ``logits[B, vocab]`` (fp32), as an int64 tensor on ``logits``' device."""
        greedy = logits.argmax(dim=-1)
        sampled_rows = [i for i, p in enumerate(params) if not p.greedy]
        if not sampled_rows:
            return greedy
        dev = logits.device
        rows = to_device(sampled_rows, torch.int64, dev)
        sub = logits[rows]
        temps = to_device([params[i].temperature for i in sampled_rows], torch.float32, dev)
        sub = sub / temps.unsqueeze(1)
        sub = _apply_top_k(sub, [params[i].top_k for i in sampled_rows])
        sub = _apply_top_p(sub, [params[i].top_p for i in sampled_rows])
        probs = torch.softmax(sub, dim=-1)
        noise = torch.empty_like(probs)
        unseeded = []
        for j, i in enumerate(sampled_rows):
            seed = params[i].seed
            if seed is None:
                unseeded.append(j)
            else:
                noise[j].exponential_(generator=self._generator(request_ids[i], seed))
        if unseeded:
            idx = to_device(unseeded, torch.int64, dev)
            noise[idx] = torch.empty(len(unseeded), probs.shape[1], device=dev).exponential_(
                generator=self.generator
            )
        choice = (probs / noise).argmax(dim=-1)
        out = greedy.clone()
        out[rows] = choice
        return out


def to_device(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A small host list as a device tensor without a host synchronisation.

    On CUDA the values are staged in pinned memory (the caching host allocator
    keeps the buffer alive until the copy has run) and copied ``non_blocking``.
    """
    if device.type == "cpu":
        return torch.tensor(values, dtype=dtype)
    return torch.tensor(values, dtype=dtype, pin_memory=True).to(device, non_blocking=True)


def _apply_top_k(logits: torch.Tensor, top_ks: list[int]) -> torch.Tensor:
    vocab = logits.shape[1]
    ks = [k if 0 < k < vocab else vocab for k in top_ks]
    if all(k == vocab for k in ks):
        return logits
    k_max = max(ks)
    top = logits.topk(k_max, dim=-1).values
    kth = top.gather(1, to_device(ks, torch.int64, logits.device).unsqueeze(1) - 1)
    return logits.masked_fill(logits < kth, float("-inf"))


def _apply_top_p(logits: torch.Tensor, top_ps: list[float]) -> torch.Tensor:
    if all(p >= 1.0 for p in top_ps):
        return logits
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    probs = sorted_logits.softmax(dim=-1)
    before = probs.cumsum(dim=-1) - probs  # mass strictly ahead of each token
    p = to_device(top_ps, probs.dtype, logits.device).unsqueeze(1)
    drop_sorted = before >= p  # keeps the smallest prefix reaching p; the top token always stays
    drop = torch.zeros_like(drop_sorted).scatter(1, order, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))
