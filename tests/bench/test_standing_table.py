"""The README's standing table is ``standing_table.py``'s output over the committed H200 files,
and Dynamo's column is the real router's only where the runs carry its record."""

from __future__ import annotations

import pytest
from benchmarks import standing_table


def test_the_readme_table_is_generated_from_the_committed_files():
    assert standing_table.main(["--check"]) == 0, "run python -m benchmarks.standing_table"


def test_dynamo_is_the_real_router_only_where_its_runs_carry_its_record():
    assert standing_table.peer_column("dynamo_kv", [{"dynamo": {"version": "1.6.1"}}]) == "Dynamo's router"
    assert standing_table.peer_column("dynamo_kv", [{}]) == "Dynamo copy"  # the name's meaning before e6c6039
    assert standing_table.peer_column("dynamo_kv_copy", []) == "Dynamo copy"
    assert standing_table.peer_column("lmpool-routing", []) is None


def test_the_table_replaces_only_what_lies_between_its_markers():
    text = f"head\n{standing_table.BEGIN}\nold\n{standing_table.END}\ntail\n"
    assert standing_table.spliced(text, "new") == f"head\n{standing_table.BEGIN}\nnew\n{standing_table.END}\ntail\n"
    with pytest.raises(ValueError, match="no"):
        standing_table.spliced("no markers", "new")
