"""The CUDA kernel loader's behaviour that does not need a GPU: sources, targets, errors."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lmpool.ops import cuda, get_backend


def test_sources_are_found():
    folder = cuda.kernel_source_dir()
    assert (folder / "bindings.cpp").is_file()
    assert (folder / "attention_rows.cuh").is_file()


def test_hopper_gets_sm90a_and_a_portable_ptx_target():
    flags = cuda.arch_flags((9, 0))
    assert "-gencode=arch=compute_90a,code=sm_90a" in flags
    assert "-gencode=arch=compute_80,code=compute_80" in flags
    assert cuda.arch_flags((8, 9))[0] == "-gencode=arch=compute_89,code=sm_89"


def test_cuda_ops_keep_the_reference_signatures():
    import dataclasses
    import inspect

    from lmpool.ops import TORCH_OPS

    for name in (f.name for f in dataclasses.fields(TORCH_OPS) if f.name != "name"):
        ours = inspect.signature(getattr(cuda.CUDA_OPS, name))
        theirs = inspect.signature(getattr(TORCH_OPS, name))
        assert list(ours.parameters) == list(theirs.parameters), name


def test_cpu_devices_get_the_torch_ops():
    assert get_backend("cpu").name == "torch"


@pytest.mark.parametrize("head_dim", [32, 96, 256])
def test_a_head_dim_the_kernels_lack_falls_back_to_the_torch_ops_saying_so(head_dim):
    """Decided before the extension is touched, so this holds with or without CUDA."""
    with pytest.warns(RuntimeWarning, match=f"head_dim 64 or 128, this model has {head_dim}"):
        assert get_backend("cuda", head_dim=head_dim).name == "torch"


def test_flash_prefill_on_a_torch_without_paged_flash_reads_the_keys_gathered(monkeypatch):
    """torch 2.11's FlashAttention takes no block tables: asking for it there gives the ops that
    gather the keys out of the paged cache first, decided from the op's schema (no kernel is
    touched); the reason names the torch."""
    class Op:  # a torch 2.11 schema
        _schema = "aten::_flash_attention_forward(Tensor query, ..., Tensor? seqused_k=None, Tensor? alibi_slopes=None)"

    has_tables = "block_table" in str(torch.ops.aten._flash_attention_forward.default._schema)
    assert (cuda.flash_paged_unavailable() is None) == has_tables  # 2.13 has them, 2.11 not
    monkeypatch.setattr(torch.ops.aten._flash_attention_forward, "default", Op)
    assert re.match(f"torch {re.escape(torch.__version__)}'s FlashAttention reads no block tables",
                    cuda.flash_paged_unavailable())
    assert get_backend("cuda", head_dim=128, prefill_attention="flash") is cuda.FLASH_GATHER_OPS
    assert get_backend("cpu", prefill_attention="flash").name == "torch"


def test_flash_prefill_gathers_the_keys_of_blocks_its_pages_cannot_hold(monkeypatch):
    """A torch whose FlashAttention reads block tables reads the cache's blocks as its pages only
    where they are a multiple of its page size; other block sizes gather the keys first."""
    class Op:  # a torch with paged FlashAttention
        _schema = "aten::_flash_attention_forward(Tensor query, ..., Tensor? block_table=None)"

    monkeypatch.setattr(torch.ops.aten._flash_attention_forward, "default", Op)
    assert get_backend("cuda", head_dim=128, prefill_attention="flash", block_size=256) is cuda.FLASH_PREFILL_OPS
    assert get_backend("cuda", head_dim=128, prefill_attention="flash", block_size=16) is cuda.FLASH_GATHER_OPS
    assert get_backend("cuda", head_dim=128, block_size=16) is cuda.CUDA_OPS


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error raised without CUDA")
def test_loading_without_cuda_raises_a_clear_error():
    with pytest.raises(RuntimeError, match="CUDA") as info:
        cuda.load_extension()
    assert "use_kernels=False" in str(info.value)
    with pytest.raises(RuntimeError, match="CUDA"):
        cuda.CUDA_OPS.pack_kv(torch.zeros(1, 2, 1, 1, 1, 8), torch.zeros(1, dtype=torch.int64))


def test_the_checkout_kernels_folder_never_shadows_an_installed_kernels_package():
    """transformers imports the Hugging Face ``kernels`` package when it is installed; run from
    the checkout (the repository root first on sys.path), ``import kernels`` must not find ours."""
    root = Path(cuda.__file__).resolve().parents[2]
    found = subprocess.run(
        [sys.executable, "-c", "import kernels; print(getattr(kernels, '__file__', None))"],
        cwd=root, capture_output=True, text=True, check=True,
    ).stdout.strip()
    assert not found.startswith(str(root / "kernels")), found
