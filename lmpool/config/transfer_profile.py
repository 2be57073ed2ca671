"""A KV-transfer calibration profile (``benchmarks/benchmark_kv_transfer.py`` writes one): read and
checked where a pool is configured, so a profile a pool cannot use is refused before anything
starts; the control process's cost model (``control/transfers/cost_model.py``) is built from it.

Invariants: a profile is accepted only for the KV bytes per block it was measured with (a curve
measured for another shape would be meaningless), and every pair it names has a measured size.
"""

from __future__ import annotations

from pathlib import Path

import msgspec


class SizePoint(msgspec.Struct):
    p95_s: float  # the data path's P95 seconds (pack, send, receive, unpack) at this many blocks


class MeasuredModel(msgspec.Struct):
    kv_bytes_per_block: int


class TransferProfile(msgspec.Struct):
    model: MeasuredModel
    pairs: dict[str, dict[int, SizePoint]]  # "src->dst" -> block count -> its data path
    residual_p95_s: dict[str, dict[int, float]] = {}  # "src->dst" -> size bucket -> the rest of a plan

    @classmethod
    def read(cls, profile: dict | str | Path, kv_bytes_per_block: int) -> TransferProfile:
        """The profile (a dict, or a JSON file) for a model of ``kv_bytes_per_block``; ``ValueError``
        (``OSError`` for a file that cannot be read) saying why it cannot be used."""
        try:
            if isinstance(profile, dict):  # JSON's keys are strings: sizes convert from them
                read = msgspec.convert(profile, cls, strict=False)
            else:
                read = msgspec.json.decode(Path(profile).read_bytes(), type=cls)
        except msgspec.ValidationError as e:
            raise ValueError(f"not a transfer profile: {e}") from None
        measured = read.model.kv_bytes_per_block
        if measured != kv_bytes_per_block:
            raise ValueError(
                f"transfer profile was measured for {measured} KV bytes per block, but the serving "
                f"model has {kv_bytes_per_block}: recalibrate with benchmarks/benchmark_kv_transfer.py"
            )
        for pair, points in read.pairs.items():
            if not points:
                raise ValueError(f"transfer profile has no measurements for pair {pair}")
        return read
