"""``PoolConfig``: where each rank runs, what engine arguments it gets, and when a silent process
is taken for hung. Replicas that share a GPU split its ``gpu_memory_utilization`` (each worker
sizes its KV cache from its own share: given the whole, the second on a GPU asks for memory
the first holds)."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import msgspec
import pytest
import torch

from lmpool.config.kv_events import KVEventsConfig
from lmpool.config.pool import PoolConfig, reset_config
from lmpool.config.routing import RoutingConfig
from lmpool.frontend.client import with_gpus


@pytest.fixture
def gpus(monkeypatch):
    """Pretend torch sees ``n`` CUDA devices: the pool's start reads their count into the config."""

    def see(n: int) -> None:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: n > 0)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: n)

    return see


def config(world_size: int, device: str = "cuda", **engine) -> PoolConfig:
    return with_gpus(PoolConfig.from_options("m", world_size=world_size, device=device, **engine))


def test_replicas_sharing_a_gpu_split_its_memory_share(gpus):
    gpus(2)
    cfg = config(5, gpu_memory_utilization=0.9)
    assert [cfg.device_of(r) for r in range(5)] == ["cuda:0", "cuda:1", "cuda:0", "cuda:1", "cuda:0"]
    shares = [cfg.engine_of(r).gpu_memory_utilization for r in range(5)]
    assert shares == pytest.approx([0.3, 0.45, 0.3, 0.45, 0.3])
    for gpu in (0, 1):  # the replicas of one GPU fill together what it was given
        assert sum(s for r, s in enumerate(shares) if r % 2 == gpu) == pytest.approx(0.9)
    assert cfg.engine.gpu_memory_utilization == 0.9, "the pool's own arguments are left as given"


def test_a_replica_alone_on_its_gpu_takes_the_whole_share(gpus):
    gpus(4)
    cfg = config(3, gpu_memory_utilization=0.8)
    assert [cfg.engine_of(r).gpu_memory_utilization for r in range(3)] == [0.8] * 3


def test_a_fixed_block_count_is_taken_as_given(gpus):
    gpus(1)
    cfg = config(2, num_kv_blocks=64)
    assert [(e.num_kv_blocks, e.gpu_memory_utilization) for e in map(cfg.engine_of, range(2))] == [(64, 0.9)] * 2


def test_cpu_replicas_keep_their_arguments_but_each_samples_its_own_stream():
    cfg = config(3, device="cpu", seed=7)
    assert [cfg.device_of(r) for r in range(3)] == ["cpu"] * 3
    assert cfg.engine_of(0) is cfg.engine  # rank 0 samples as an LLM with the pool's seed would
    assert [cfg.engine_of(r).seed for r in range(3)] == [7, 8, 9]
    assert all(dataclasses.replace(cfg.engine_of(r), seed=7) == cfg.engine for r in range(3))


def test_hang_detection_is_on_by_default_on_gpus_only_and_takes_positive_seconds(gpus):
    gpus(1)
    assert config(1).hang_timeout == 60.0  # a GPU step takes milliseconds
    assert config(1, device="cpu").hang_timeout is None  # a CPU step of a large model may take minutes
    assert PoolConfig.from_options("m", device="cpu", hang_timeout=2.5).hang_timeout == 2.5
    assert PoolConfig.from_options("m", device="cuda", hang_timeout=None).hang_timeout is None
    for bad in (0, -1.0, "soon", True):
        with pytest.raises(ValueError, match="hang_timeout must be a positive number of seconds"):
            PoolConfig.from_options("m", device="cpu", hang_timeout=bad)


def test_a_given_gpu_count_is_kept_and_the_ranks_take_those_gpus(gpus):
    gpus(8)
    cfg = config(3, gpus=2)
    assert cfg.gpus == 2 and cfg.gpu_of_rank() == [0, 1, 0]
    assert config(3).gpu_of_rank() == [0, 1, 2], "unset, the pool takes every GPU torch sees"
    with pytest.raises(ValueError, match="gpus must be an integer >= 1 or None"):
        config(2, gpus=0)


def test_a_cuda_pool_where_torch_sees_no_gpu_is_refused_before_anything_starts(gpus):
    gpus(0)
    with pytest.raises(ValueError, match="device='cuda' was asked for but torch sees no CUDA device"):
        config(2)
    unresolved = PoolConfig.from_options("m", world_size=2, device="cuda")
    with pytest.raises(ValueError, match="GPU count is set when the pool starts"):
        unresolved.engine_of(1)


def test_the_configuration_tree_and_the_control_process_import_no_torch():
    """The control process decodes the tree and routes: torch (1 s to import, and a heap the
    garbage collector would walk) has no business there."""
    code = "import sys, lmpool.config.pool, lmpool.control.main; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_kv_events_are_a_section_of_the_tree_given_as_a_struct_or_a_dict_of_its_fields():
    events = {"endpoint": "tcp://127.0.0.1:5557", "replay_endpoint": "tcp://127.0.0.1:5558", "int_hashes": False}
    cfg = config(2, device="cpu", kv_events=events)
    assert cfg.kv_events == KVEventsConfig(**events) and cfg.kv_events.array_like
    assert msgspec.json.decode(msgspec.json.encode(cfg), type=PoolConfig) == cfg  # it travels in every spec
    assert config(2, device="cpu").kv_events is None
    with pytest.raises(ValueError, match="kv_events.endpoint must be a ZMQ endpoint"):
        config(2, device="cpu", kv_events={"endpoint": ""})
    with pytest.raises(ValueError, match="kv_events must be a KVEventsConfig"):
        config(2, device="cpu", kv_events="tcp://127.0.0.1:5557")


def test_a_reset_switches_what_only_the_control_process_reads_and_refuses_the_rest():
    cfg = PoolConfig.from_options("m", world_size=2, device="cpu", transfer_mode="pull")
    switched = reset_config(cfg, True, {"routing": "round_robin", "transfer_mode": "none"})
    assert (switched.routing, switched.transfer.transfer_mode) == ("round_robin", "none")
    assert switched.transfer.enable_transfers and switched.engine == cfg.engine
    assert reset_config(switched, True, {"routing": "lmpool", "transfer_mode": "pull"}).transfer.route_pulls
    with pytest.raises(TypeError, match="block_size"):
        reset_config(cfg, True, {"block_size": 32})
    with pytest.raises(ValueError, match="cascade_groups"):
        reset_config(cfg, True, {"routing_config": RoutingConfig(cascade_groups=not cfg.routing_config.cascade_groups)})
    with pytest.raises(ValueError, match="started with transfers"):
        reset_config(PoolConfig.from_options("m", device="cpu", transfer_mode="none"), False, {"transfer_mode": "pull"})
    with pytest.raises(ValueError, match="foreground"):
        reset_config(cfg, True, {"transfer_mode": "foreground"})
    with pytest.raises(ValueError, match="routing must be one of"):
        reset_config(cfg, True, {"routing": "no-such-rule"})
