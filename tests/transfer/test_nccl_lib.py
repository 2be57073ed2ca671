"""The ctypes binding of NCCL (``lmpool/dataplane/nccl_lib.py``): a library that cannot be
loaded is reported with every place tried, arguments are checked before NCCL sees them,
and, with a GPU, the library answers its version and makes distinct communicator ids.
Transfers through it: ``test_nccl_gpu.py`` (two GPUs)."""

from __future__ import annotations

import pytest
import torch

from lmpool.dataplane import nccl_lib


@pytest.fixture
def fresh_library():
    nccl_lib.library.cache_clear()
    yield
    nccl_lib.library.cache_clear()


def test_a_library_that_cannot_be_loaded_is_named_with_every_place_tried(monkeypatch, fresh_library):
    monkeypatch.setattr(nccl_lib, "_candidates", lambda: ["/nowhere/libnccl.so.2", "/elsewhere/libnccl.so.2"])
    with pytest.raises(nccl_lib.NcclError, match="LMPOOL_NCCL_LIBRARY") as raised:
        nccl_lib.library()
    assert "/nowhere/libnccl.so.2" in str(raised.value) and "/elsewhere/libnccl.so.2" in str(raised.value)


def test_the_environment_names_the_first_place_to_look(monkeypatch):
    monkeypatch.setenv("LMPOOL_NCCL_LIBRARY", "/opt/nccl/lib/libnccl.so.2")
    assert nccl_lib._candidates()[:2] == ["/opt/nccl/lib/libnccl.so.2", "libnccl.so.2"]
    monkeypatch.delenv("LMPOOL_NCCL_LIBRARY")
    assert nccl_lib._candidates()[0] == "libnccl.so.2"


def test_a_unique_id_of_the_wrong_size_is_refused_before_nccl_sees_it():
    with pytest.raises(ValueError, match="an NCCL unique id has 128 bytes, got 3"):
        nccl_lib.Communicator(b"abc", 2, 0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_library_torch_loads_answers_its_version_and_makes_distinct_ids():
    assert nccl_lib.version().startswith("2.")
    a, b = nccl_lib.unique_id(), nccl_lib.unique_id()
    assert len(a) == len(b) == nccl_lib.UNIQUE_ID_BYTES and a != b


def test_a_library_without_the_nccl_calls_is_passed_over(monkeypatch, fresh_library):
    """Something else answering to the name (here the C library) is not taken for NCCL."""
    monkeypatch.setattr(nccl_lib, "_candidates", lambda: ["libc.so.6"])
    with pytest.raises(nccl_lib.NcclError, match="libc.so.6 .*ncclGetVersion"):
        nccl_lib.library()
