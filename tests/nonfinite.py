"""Makes the model's logits non-finite for chosen requests, to test that such a request fails
alone: the rows of sequences whose prompt starts with ``POISON`` get ``value`` in one logit
once they have ``AFTER`` tokens, so a stream shows tokens first and then fails mid-way.

In-process tests patch ``ModelRunner.sample_checked`` with ``poisoning``; a pool's workers
are patched at start-up by the ``sitecustomize`` that ``write_sitecustomize`` writes."""

from __future__ import annotations

import functools
from pathlib import Path

POISON = 997
AFTER = 3


def poisoned(seq, after: int = AFTER) -> bool:
    return seq.token_ids[0] == POISON and len(seq) - seq.num_prompt_tokens >= after


def poisoning(sample_checked, value: float = float("nan")):
    """``sample_checked`` with the logits of poisoned rows corrupted before they are checked."""
    @functools.wraps(sample_checked)
    def wrapper(runner, hidden, seqs, *rest):
        rows = [i for i, seq in enumerate(seqs) if poisoned(seq)]
        if not rows:
            return sample_checked(runner, hidden, seqs, *rest)
        compute = runner.model.compute_logits

        def compute_logits(h, fp32=True, **ops):
            logits = compute(h, fp32=fp32, **ops)
            logits[rows, 5] = value  # one entry is enough: a row must be finite throughout
            return logits

        runner.model.compute_logits = compute_logits  # shadows the method for this call only
        try:
            return sample_checked(runner, hidden, seqs, *rest)
        finally:
            del runner.model.compute_logits
    return wrapper


def write_sitecustomize(folder: Path, value: float = float("nan")) -> None:
    """A ``sitecustomize`` in ``folder`` (for a pool's children's ``PYTHONPATH``) that installs ``poisoning``."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "sitecustomize.py").write_text(
        "import sys\n"
        f"sys.path.insert(0, {str(Path(__file__).parent)!r})\n"
        "import nonfinite\n"
        "from lmpool.engine.model_runner import ModelRunner\n"
        f"ModelRunner.sample_checked = nonfinite.poisoning(ModelRunner.sample_checked, float({str(value)!r}))\n"
    )
