"""``lmpool serve``'s command line refuses, by name, values it would otherwise act on wrongly."""

from __future__ import annotations

import json
import socket

import msgspec
import pytest

from lmpool.frontend.serve.server import kv_events_config, main, parser, read_kv_events_config, settings_from


@pytest.mark.parametrize("args, words", [
    (["--port", "99999"], "--port: must be a TCP port in [0, 65535]"),  # was served on 99999 % 65536
    (["--routing", "bogus"], "--routing: invalid choice: 'bogus' (choose from"),  # a traceback after start-up
    (["--port", "-1"], "--port: must be a TCP port"),
    (["--port", "http"], "--port: must be a TCP port"),
    (["--shutdown-grace", "nan"], "--shutdown-grace: must be a finite number of seconds >= 0"),
    (["--shutdown-grace", "-1"], "--shutdown-grace: must be a finite number of seconds >= 0"),
    (["--max-request-bytes", "-1"], "--max-request-bytes: must be a whole number >= 0"),
    (["--max-request-bytes", "32M"], "--max-request-bytes: must be a whole number >= 0"),
    (["--timeout-request-headers", "0"], "--timeout-request-headers: must be a finite number of seconds > 0"),
    (["--timeout-request-body", "inf"], "--timeout-request-body: must be a finite number of seconds >= 0"),
    (["--timeout-keep-alive", "nan"], "--timeout-keep-alive: must be a finite number of seconds >= 0"),
    (["--limit-concurrency", "many"], "--limit-concurrency: must be a whole number >= 0"),
])
def test_bad_values_are_refused_by_name(args, words, capsys):
    with pytest.raises(SystemExit) as exit_:
        parser().parse_args(["model", *args])
    assert exit_.value.code == 2 and words in capsys.readouterr().err


def test_the_device_defaults_to_cuda_when_present_as_the_demo_s(monkeypatch):
    import torch

    for present, device in ((True, "cuda"), (False, "cpu")):
        monkeypatch.setattr(torch.cuda, "is_available", lambda: present)
        assert parser().parse_args(["model"]).device == device


def test_vllm_s_flag_names_reach_the_pool():
    args = parser().parse_args(["model", "--data-parallel-size", "3", "--gpu-memory-utilization", "0.5",
                                "--no-enable-prefix-caching", "--seed", "7"])
    pool_args = settings_from(args).pool_args
    assert (pool_args["world_size"], pool_args["gpu_memory_utilization"]) == (3, 0.5)
    assert (pool_args["enable_prefix_caching"], pool_args["seed"]) == (False, 7)
    assert settings_from(parser().parse_args(["model", "-dp", "2", "--enable-prefix-caching"])).pool_args == \
        {**settings_from(parser().parse_args(["model", "--world-size", "2"])).pool_args, "enable_prefix_caching": True}
    assert "seed" not in settings_from(parser().parse_args(["model"])).pool_args  # the engine's default


def vllm_events(config: dict, *extra: str) -> dict | None:
    p = parser()
    args = p.parse_args(["model", "--kv-events-config", json.dumps(config), *extra])
    read_kv_events_config(p, args)
    events = kv_events_config(args)
    return None if events is None else msgspec.structs.asdict(events)


def test_vllm_s_kv_events_config_maps_onto_the_publisher_s_settings():
    events = vllm_events({"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": "tcp://127.0.0.1:6000",
                          "replay_endpoint": "tcp://127.0.0.1:6001", "topic": "t", "buffer_steps": 50, "hwm": 10})
    assert events == {"endpoint": "tcp://127.0.0.1:6000", "replay_endpoint": "tcp://127.0.0.1:6001", "topic": "t",
                      "buffer_steps": 50, "replay_max_batches": 1_000, "array_like": True, "int_hashes": True}
    defaults = vllm_events({"enable_kv_cache_events": True})
    assert (defaults["endpoint"], defaults["topic"], defaults["buffer_steps"]) == ("tcp://127.0.0.1:5557", "", 10_000)
    assert vllm_events({"enable_kv_cache_events": False, "endpoint": "tcp://127.0.0.1:6000"}) is None
    assert vllm_events({"enable_kv_cache_events": True, "publisher": "null"}) is None


@pytest.mark.parametrize("config, extra, words", [
    ("[1]", (), "--kv-events-config: must be a JSON object"),
    ("{", (), "--kv-events-config: not JSON"),
    ('{"enable_kv_cache_events": true, "endpont": "x"}', (), "unknown field(s) endpont"),
    ('{"enable_kv_cache_events": "yes"}', (), "enable_kv_cache_events must be bool"),
    ('{"enable_kv_cache_events": true, "publisher": "kafka"}', (), "publisher must be 'zmq' or 'null'"),
    ('{"enable_kv_cache_events": true, "buffer_steps": 0}', (), "buffer_steps must be >= 1"),
    ('{"enable_kv_cache_events": true}', ("--kv-events-endpoint", "tcp://127.0.0.1:1"), "give one or the other"),
])
def test_a_bad_kv_events_config_is_refused_by_name(config, extra, words, capsys):
    p = parser()
    args = p.parse_args(["model", "--kv-events-config", config, *extra])
    with pytest.raises(SystemExit) as exit_:
        read_kv_events_config(p, args)
    assert exit_.value.code == 2 and words in capsys.readouterr().err


def test_good_values_are_taken():
    args = parser().parse_args(["model", "--port", "0", "--shutdown-grace", "0"])
    assert args.port == 0 and args.shutdown_grace == 0


def test_a_taken_port_is_refused_before_the_pool_starts(tiny_model):
    """vLLM binds first; so does this check: no process is started."""
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        with pytest.raises(SystemExit, match=f"cannot bind 127.0.0.1:{port}: Address already in use"):
            main([tiny_model, "--port", str(port)])


@pytest.mark.parametrize("args, words", [
    (["{missing}"], "model directory not found"),
    (["{model}", "--world-size", "0"], "world_size must be an integer >= 1, got 0"),
    (["{model}", "--block-size", "7"], "block_size"),
])
def test_a_missing_model_or_a_setting_the_pool_refuses_is_one_line_before_anything_starts(tiny_model, tmp_path,
                                                                                         args, words, capsys):
    argv = [a.format(model=tiny_model, missing=tmp_path / "no-model-here") for a in args]
    with pytest.raises(SystemExit) as exit_:
        main([*argv, "--port", "0"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and words in err and "Traceback" not in err


def test_the_start_up_line_names_the_pool_its_ranks_and_how_to_watch_it(tiny_model):
    import uvloop

    from lmpool.frontend.api import AsyncLMPool
    from lmpool.frontend.serve.app import started_line

    async def main_():
        async with AsyncLMPool(tiny_model, world_size=2, block_size=16, num_kv_blocks=40) as pool:
            return pool.pool_id, started_line(pool)

    pool_id, line = uvloop.run(main_())
    assert line == (f"pool {pool_id} started: 2 ranks (r0 cpu 40 blocks, r1 cpu 40 blocks) of 16-token KV blocks, "
                    f"routing lmpool; watch it with: lmpool top {pool_id}")
