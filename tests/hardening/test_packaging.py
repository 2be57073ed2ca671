"""What a built wheel holds: every package of the source tree is in ``pyproject.toml``'s package
list (an editable install finds an unlisted one; a wheel would not carry it)."""

from __future__ import annotations

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_every_lmpool_package_is_listed_for_the_wheel():
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(config["packages"])
    found = {".".join(d.relative_to(ROOT).parts) for d in (ROOT / "lmpool").rglob("__init__.py")
             for d in [d.parent]}
    assert found - listed == set(), "packages the wheel would leave out"
    assert listed - found - {"lmpool_ipc", "lmpool_kernels", "lmpool_tools"} == set(), "listed packages that do not exist"
