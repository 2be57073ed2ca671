"""Topology: explicit pairs, the virtual full mesh, ``nvidia-smi topo -m`` parsing (NV# links only),
detection, and the errors for bad input."""

from __future__ import annotations

import sys

import pytest

from lmpool.control import topology as topology_module
from lmpool.control.topology import NO_LINK, NVLINK, SAME_GPU, Topology

# `nvidia-smi topo -m` on an 8x H100 SXM node: every GPU pair over NVSwitch (NV18), two NICs.
# Cells are tab-separated; the first header cell is empty and "GPU NUMA ID" may hold an empty cell.
DGX_H100 = (
    "\t\x1b[4mGPU0\tGPU1\tGPU2\tGPU3\tGPU4\tGPU5\tGPU6\tGPU7\tNIC0\tNIC1\tCPU Affinity\tNUMA Affinity"
    "\tGPU NUMA ID\x1b[0m\n"
    + "".join(
        f"GPU{i}\t" + "\t".join(" X " if j == i else "NV18" for j in range(8))
        + ("\tPXB\tSYS\t0-55,112-167\t0\t\tN/A\n" if i < 4 else "\tSYS\tPXB\t56-111,168-223\t1\t\tN/A\n")
        for i in range(8)
    )
    + "NIC0\tPXB\tPXB\tPXB\tPXB\tSYS\tSYS\tSYS\tSYS\t X \tSYS\n"
    + "NIC1\tSYS\tSYS\tSYS\tSYS\tPXB\tPXB\tPXB\tPXB\tSYS\t X \n"
    + """
Legend:

  X    = Self
  SYS  = Connection traversing PCIe as well as the SMP interconnect between NUMA nodes (e.g., QPI/UPI)
  NODE = Connection traversing PCIe as well as the interconnect between PCIe Host Bridges within a NUMA node
  PHB  = Connection traversing PCIe as well as a PCIe Host Bridge (typically the CPU)
  PXB  = Connection traversing multiple PCIe bridges (without traversing the PCIe Host Bridge)
  PIX  = Connection traversing at most a single PCIe bridge
  NV#  = Connection traversing a bonded set of # NVLinks

NIC Legend:

  NIC0: mlx5_0
  NIC1: mlx5_1
"""
)

# Four PCIe GPUs with NVLink bridges on pairs (0,1) and (2,3); the rest over PCIe/SMP.
BRIDGED = """\
\tGPU0\tGPU1\tGPU2\tGPU3\tCPU Affinity\tNUMA Affinity\tGPU NUMA ID
GPU0\t X \tNV12\tNODE\tSYS\t0-31\t0\t\tN/A
GPU1\tNV12\t X \tPHB\tSYS\t0-31\t0\t\tN/A
GPU2\tNODE\tPHB\t X \tNV12\t32-63\t1\t\tN/A
GPU3\tSYS\tSYS\tNV12\t X \t32-63\t1\t\tN/A

Legend:

  X    = Self
  PIX  = Connection traversing at most a single PCIe bridge
  NV#  = Connection traversing a bonded set of # NVLinks
"""


def test_pairs_give_symmetric_affinity_partners_and_candidates():
    topo = Topology.from_pairs(4, [(0, 1), (3, 2)])
    assert topo.affinity(0, 1) == topo.affinity(1, 0) == NVLINK
    assert topo.affinity(2, 3) == topo.affinity(3, 2) == NVLINK
    assert topo.affinity(0, 2) == NO_LINK
    assert topo.affinity(1, 1) == SAME_GPU
    assert topo.partners(0) == (1,) and topo.partners(3) == (2,)
    assert topo.candidates(0) == [0, 1] and topo.candidates(2) == [2, 3]
    assert topo.candidates(None) == [0, 1, 2, 3]
    assert topo.candidate_mask(1) == 0b0011


def test_ranks_sharing_a_gpu_are_partners_with_affinity_two():
    topo = Topology.from_pairs(4, [(1, 2)], gpu_of_rank=[0, 0, 1, 1])
    assert topo.affinity(0, 1) == SAME_GPU and topo.affinity(2, 3) == SAME_GPU
    assert topo.affinity(1, 2) == NVLINK and topo.affinity(0, 3) == NO_LINK
    assert topo.partners(1) == (0, 2)
    assert topo.candidates(0) == [0, 1]


def test_virtual_is_a_full_mesh_of_separate_gpus():
    topo = Topology.virtual(3)
    assert [[topo.affinity(a, b) for b in range(3)] for a in range(3)] == [[2, 1, 1], [1, 2, 1], [1, 1, 2]]
    assert all(topo.candidates(r) == [0, 1, 2] for r in range(3))
    assert Topology.virtual(1).candidates(0) == [0]


@pytest.mark.parametrize(
    "pairs, message",
    [([(0, 4)], "outside 0..3"), ([(-1, 0)], "outside 0..3"), ([(2, 2)], "to itself")],
)
def test_bad_pairs_are_rejected(pairs, message):
    with pytest.raises(ValueError, match=message):
        Topology.from_pairs(4, pairs)


def test_bad_sizes_and_seeds_are_rejected():
    with pytest.raises(ValueError, match="3 entries for world_size 4"):
        Topology.from_pairs(4, [], gpu_of_rank=[0, 1, 2])
    with pytest.raises(ValueError, match="world_size must be >= 1"):
        Topology.virtual(0)
    with pytest.raises(ValueError, match="seed rank 4 is out of range"):
        Topology.virtual(4).candidates(4)


def test_nvidia_smi_full_nvswitch_mesh():
    topo = Topology.from_nvidia_smi(DGX_H100, gpu_of_rank=list(range(8)))
    assert all(topo.affinity(a, b) == NVLINK for a in range(8) for b in range(8) if a != b)
    assert topo.candidates(5) == list(range(8))


def test_nvidia_smi_keeps_only_nvlink_pairs():
    topo = Topology.from_nvidia_smi(BRIDGED, gpu_of_rank=[0, 1, 2, 3])
    assert topo.partners(0) == (1,) and topo.partners(2) == (3,)
    assert topo.affinity(1, 2) == NO_LINK  # PHB: PCIe through the host bridge
    assert topo.affinity(0, 2) == NO_LINK  # NODE


def test_nvidia_smi_with_two_ranks_per_gpu():
    topo = Topology.from_nvidia_smi(BRIDGED, gpu_of_rank=[0, 0, 1, 2, 3, 3])
    assert topo.affinity(0, 1) == SAME_GPU and topo.affinity(4, 5) == SAME_GPU
    assert topo.affinity(0, 2) == NVLINK and topo.affinity(1, 2) == NVLINK
    assert topo.affinity(3, 4) == NVLINK and topo.affinity(2, 3) == NO_LINK
    assert topo.candidates(2) == [0, 1, 2]


def test_nvidia_smi_bad_input():
    with pytest.raises(ValueError, match="no 'GPU0 GPU1 ...' header"):
        Topology.from_nvidia_smi("No devices were found\n", gpu_of_rank=[0])
    with pytest.raises(ValueError, match="GPU5, which the topology matrix does not list"):
        Topology.from_nvidia_smi(BRIDGED, gpu_of_rank=[0, 5])
    truncated = "\n".join(BRIDGED.splitlines()[:3])
    with pytest.raises(ValueError, match="do not match the header"):
        Topology.from_nvidia_smi(truncated, gpu_of_rank=[0, 1])
    short_row = "\tGPU0\tGPU1\nGPU0\t X \nGPU1\tNV4\t X \n"
    with pytest.raises(ValueError, match="GPU0 has 1 GPU cells, expected 2"):
        Topology.from_nvidia_smi(short_row, gpu_of_rank=[0, 1])


def test_detect_cpu_and_cuda_with_nvidia_smi(monkeypatch):
    assert Topology.detect(3, "cpu").candidates(0) == [0, 1, 2]
    monkeypatch.setattr(topology_module, "_run_nvidia_smi", lambda: BRIDGED)
    topo = Topology.detect(8, "cuda")  # ranks round robin over the GPUs it lists
    assert topo.gpu_of_rank == (0, 1, 2, 3, 0, 1, 2, 3)
    assert topo.affinity(0, 4) == SAME_GPU and topo.affinity(0, 5) == NVLINK and topo.affinity(0, 2) == NO_LINK
    assert Topology.detect(2, "cuda:0", gpu_of_rank=[2, 3]).affinity(0, 1) == NVLINK


def test_detect_cuda_without_a_working_nvidia_smi(monkeypatch):
    """Nothing is known about links: a full mesh, and ranks sharing a GPU still get affinity 2."""
    monkeypatch.setattr(topology_module.shutil, "which", lambda name: None)
    topo = Topology.detect(3, "cuda", gpu_of_rank=[0, 0, 1])
    assert topo.affinity(0, 1) == SAME_GPU and topo.affinity(0, 2) == NVLINK
    assert Topology.detect(2, "cuda").candidates(1) == [0, 1]
    # An nvidia-smi that fails (no driver) is the same as none.
    monkeypatch.setattr(topology_module.shutil, "which", lambda name: sys.executable)
    assert topology_module._run_nvidia_smi() is None
    assert Topology.detect(2, "cuda").affinity(0, 1) == NVLINK
