"""Bytes from shared memory must never be able to run code: nothing under ipc/ or
lmpool/ pickles or unpickles. (Peer processes of the other tests run with pickle made
unimportable, so the whole IPC path is exercised without it.)"""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# multiprocessing pickles every Queue/Pipe message and, under spawn, a Process's
# arguments; LMPool starts its processes with subprocess and talks over lmpool_ipc.
PICKLING_MODULES = {
    "pickle", "_pickle", "cloudpickle", "dill", "shelve", "marshal", "multiprocessing"
}
PICKLING_CALLS = {("torch", "load"), ("torch", "save")}


def sources():
    for package in ("ipc", "lmpool"):
        yield from sorted((ROOT / package).rglob("*.py"))


def pickling_uses(tree: ast.AST):
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            modules = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            modules = [node.module or ""]
        else:
            modules = []
        for module in modules:
            if module.split(".")[0] in PICKLING_MODULES:
                yield node.lineno, f"import {module}"
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            if (node.value.id, node.attr) in PICKLING_CALLS:
                yield node.lineno, f"{node.value.id}.{node.attr}"
        if isinstance(node, ast.keyword) and node.arg == "allow_pickle":
            yield node.value.lineno, "allow_pickle="


@pytest.mark.parametrize("path", list(sources()), ids=lambda p: str(p.relative_to(ROOT)))
def test_no_pickling(path):
    assert list(pickling_uses(ast.parse(path.read_text(), filename=str(path)))) == []


def test_the_check_finds_pickling():
    source = (
        "import pickle\n"
        "from multiprocessing import Queue\n"
        "torch.load(f)\n"
        "np.load(f, allow_pickle=True)\n"
    )
    assert [line for line, _ in pickling_uses(ast.parse(source))] == [1, 2, 3, 4]
