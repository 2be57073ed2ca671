"""``benchmarks/revision.py`` for the scripts in this folder, which run with this folder on
``sys.path``, not ``benchmarks/``: the same functions, from that one source."""

from __future__ import annotations

import importlib.util
from pathlib import Path

_SOURCE = Path(__file__).resolve().parents[2] / "benchmarks" / "revision.py"
_spec = importlib.util.spec_from_file_location("benchmarks_revision", _SOURCE)
_module = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_module)

ENV, git_record, git_revision = _module.ENV, _module.git_record, _module.git_revision
