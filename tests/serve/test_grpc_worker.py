"""``lmpool serve --grpc-port``: smg's engine protocol (``vllm_engine.proto``), driven by a plain
gRPC client, on a host listening on loopback only. Generate gives one ``LLM``'s tokens, streamed
or not, and a text prompt the tokens of its ids; bad input and unsupported
settings are ``INVALID_ARGUMENT`` and the host serves on; a dropped stream aborts its request
(the pool holds no block for it); health, model info, loads and the tokenizer bundle answer; the
KV-event stream shows the host's state, then a prompt's blocks with the pool's hashes and the
prompt's tokens, resumes from a number it holds and refuses one it never sent; SIGTERM lets a
running stream finish; with ``--no-http`` the host serves gRPC alone and stops cleanly."""

from __future__ import annotations

import io
import signal
import subprocess
import sys
import threading
import zipfile

import grpc
import httpx
import pytest
from grpc_hosts import channel, generate_request, loads, pb, start_grpc_hosts, streamed_tokens, stub, subscribe
from serve_process import BLOCK, STARTUP_LIMIT_S, ServerProcess, busy, free_port, wait_for
from smg_grpc_proto.generated import common_pb2
from smg_grpc_servicer.kv_events import to_int64

from lmpool import LLM, SamplingParams
from lmpool.engine.hashing import chain_hashes
from lmpool.protocol.vllm_kv_events import external_block_hash
from lmpool.tokenizer import encode_prompt, load_tokenizer

PROMPT = list(range(300, 350))  # three complete blocks of 16 and two tokens
TOKENS = 8


@pytest.fixture(scope="module")
def expected(tiny_model):
    with LLM(tiny_model, block_size=BLOCK) as llm:
        return llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=TOKENS, ignore_eos=True))[0].token_ids


@pytest.fixture(scope="module")
def host(tiny_model, tmp_path_factory):
    server = start_grpc_hosts(1, tiny_model, tmp_path_factory.mktemp("grpc"), "--world-size", "2",
                              "--served-model-name", "tiny")[0]
    ch = channel(server)
    try:
        yield server, stub(ch)
    finally:
        ch.close()
        server.stop()


def test_generate_gives_one_engines_tokens(host, expected):
    _, s = host
    tokens, complete = streamed_tokens(s.Generate(generate_request("stream-1", PROMPT, TOKENS)))
    assert tokens == expected and complete.finish_reason == "length"
    assert complete.prompt_tokens == len(PROMPT) and complete.completion_tokens == TOKENS
    whole = list(s.Generate(generate_request("whole-1", PROMPT, TOKENS, stream=False)))
    assert len(whole) == 1 and list(whole[0].complete.output_ids) == expected
    assert whole[0].complete.cached_tokens == 3 * BLOCK  # the first request's blocks, wherever it ran


@pytest.mark.parametrize("request_", [
    generate_request("bad-vocab", [10**6], 4),
    generate_request("bad-empty", [], 4),
    generate_request("bad-n", PROMPT, 4, n=2),
    generate_request("bad-logprobs", PROMPT, 4, logprobs=1),
    generate_request("bad-penalty", PROMPT, 4, repetition_penalty=-1.0),
    generate_request("bad-min-p", PROMPT, 4, min_p=0.1),
    generate_request("bad-json", PROMPT, 4, json_schema="{}"),
    pb.GenerateRequest(request_id="bad-no-input"),
], ids=lambda r: r.request_id)
def test_bad_input_is_invalid_argument_and_harms_nothing(host, expected, request_):
    _, s = host
    with pytest.raises(grpc.RpcError) as refused:
        list(s.Generate(request_))
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT, refused.value.details()
    assert streamed_tokens(s.Generate(generate_request(f"after-{request_.request_id}", PROMPT, TOKENS)))[0] == expected


def test_penalties_give_one_engines_tokens(host, tiny_model):
    _, s = host
    penalties = {"repetition_penalty": 1.3, "presence_penalty": 0.5, "frequency_penalty": 0.2}
    with LLM(tiny_model, block_size=BLOCK) as llm:
        want = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=TOKENS, ignore_eos=True,
                                                   **penalties))[0].token_ids
    assert streamed_tokens(s.Generate(generate_request("penalized", PROMPT, TOKENS, **penalties)))[0] == want


def test_a_dropped_stream_aborts_its_request(host):
    server, s = host
    responses = s.Generate(generate_request("dropped", list(range(100, 140)), 2000))
    assert next(responses).HasField("chunk")  # running
    responses.cancel()
    wait_for(lambda: busy(server) == 0, "the dropped request's abort")
    wait_for(lambda: loads(s)[0].num_used_tokens == 0, "the dropped request's blocks freed")


def test_abort_by_id(host):
    server, s = host
    responses = s.Generate(generate_request("to-abort", list(range(150, 190)), 2000))
    assert next(responses).HasField("chunk")
    s.Abort(pb.AbortRequest(request_ids=["to-abort"]))
    _, complete = streamed_tokens(responses)
    assert complete is None or complete.finish_reason == "abort"
    wait_for(lambda: busy(server) == 0, "the aborted request's end")


def test_what_smg_reads_of_the_host(host, tiny_model):
    _, s = host
    assert s.HealthCheck(pb.HealthCheckRequest()).healthy
    info = s.GetModelInfo(pb.GetModelInfoRequest())
    assert info.served_model_name == "tiny" and info.model_path == tiny_model and info.max_context_length > 0
    server_info = s.GetServerInfo(pb.GetServerInfoRequest())
    assert server_info.block_size == BLOCK and server_info.data_parallel_size == 1
    (load,) = loads(s)
    assert load.max_total_num_tokens > 0 and load.max_running_requests > 0
    bundle = b"".join(chunk.data for chunk in s.GetTokenizer(common_pb2.GetTokenizerRequest()))
    assert "tokenizer.json" in zipfile.ZipFile(io.BytesIO(bundle)).namelist()


def test_kv_events_show_a_prompts_blocks(host):
    _, s = host
    prompt = list(range(500, 550))
    events = subscribe(s)
    first = next(events)
    assert type(first.events[0]).__name__ == "KvCacheEvent" and first.events[0].HasField("cleared")
    streamed_tokens(s.Generate(generate_request("events-1", prompt, 2)))
    want = [to_int64(external_block_hash(h)) for h in chain_hashes(prompt, BLOCK)[:3]]
    seen: dict[int, list[int]] = {}
    resume_from = None
    for batch in events:
        assert not batch.HasField("dp_rank")  # the host is one worker
        for event in batch.events:
            for block in event.stored.blocks if event.HasField("stored") else ():
                seen[block.block_hash] = list(block.token_ids)
        if resume_from is None:
            resume_from = batch.sequence_number
        if all(h in seen for h in want):
            break
    events.cancel()
    assert [seen[h] for h in want] == [prompt[i * BLOCK:(i + 1) * BLOCK] for i in range(3)]
    # A subscriber resuming from a batch the host holds gets it again; one from a number it
    # never sent is told so (smg then clears the host and asks for the state).
    resumed = subscribe(s, resume_from)
    assert next(resumed).sequence_number == resume_from
    resumed.cancel()
    with pytest.raises(grpc.RpcError) as gone:
        next(subscribe(s, 1))
    assert gone.value.code() == grpc.StatusCode.OUT_OF_RANGE


def test_sigterm_lets_a_running_stream_finish(tiny_model, tmp_path):
    server = start_grpc_hosts(1, tiny_model, tmp_path, "--shutdown-grace", "60")[0]
    ch = channel(server)
    try:
        s = stub(ch)
        responses = s.Generate(generate_request("draining", PROMPT, 64))
        assert next(responses).HasField("chunk")
        stopper = threading.Thread(target=server.proc.send_signal, args=(signal.SIGTERM,))
        stopper.start()
        tokens, complete = streamed_tokens(responses)
        stopper.join()
        assert complete is not None and complete.finish_reason == "length" and len(tokens) == 63
    finally:
        ch.close()
        server.stop()


def test_grpc_alone_without_http(tiny_model, tmp_path, expected):
    grpc_port = free_port()
    server = ServerProcess(tiny_model, "--no-http", "--grpc-port", str(grpc_port), log=tmp_path / "alone.log")
    server.grpc_port = grpc_port
    ch = channel(server)
    try:
        s = stub(ch)
        wait_for(lambda: _healthy(server, s), "the gRPC-only host's health", limit=STARTUP_LIMIT_S)
        assert streamed_tokens(s.Generate(generate_request("alone", PROMPT, TOKENS)))[0] == expected
        with pytest.raises(httpx.ConnectError):
            httpx.get(f"{server.url}/health", timeout=10)
    finally:
        ch.close()
        server.stop()
    assert server.proc.returncode == 0


def _healthy(server: ServerProcess, s) -> bool:
    assert server.proc.poll() is None, server.log.read_text()
    try:
        return s.HealthCheck(pb.HealthCheckRequest(), timeout=10).healthy
    except grpc.RpcError:
        return False


def test_no_http_needs_a_grpc_port(tiny_model):
    done = subprocess.run([sys.executable, "-m", "lmpool.cli", "serve", tiny_model, "--no-http"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 2 and "--no-http needs --grpc-port" in done.stderr


def test_a_text_prompt_is_tokenized_by_the_host(host, tiny_model):
    _, s = host
    text = "The harbour town woke slowly on winter mornings, and"
    ids = encode_prompt(load_tokenizer(tiny_model), text)
    by_text = pb.GenerateRequest(request_id="text-1", text=text, sampling_params=pb.SamplingParams(
        temperature=0, max_tokens=TOKENS, ignore_eos=True))
    (whole,) = s.Generate(by_text)
    assert whole.complete.prompt_tokens == len(ids)
    assert streamed_tokens(s.Generate(generate_request("ids-1", ids, TOKENS)))[0] == list(whole.complete.output_ids)


def test_the_grpc_port_listens_on_loopback_only(host):
    server, _ = host
    found = listening(server.grpc_port)
    assert found and set(found) <= LOOPBACK, found


# 127.0.0.1, ::ffff:127.0.0.1 (IPv4 on an IPv6 socket) and ::1, as /proc/net/tcp{,6} write them.
LOOPBACK = {"0100007F", "0000000000000000FFFF00000100007F", "00000000000000000000000001000000"}


def listening(port: int) -> list[str]:
    """The local addresses (as /proc/net/tcp{,6} write them) with a socket listening on ``port``."""
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in open(table).read().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            address, hex_port = local.split(":")
            if int(hex_port, 16) == port and state == "0A":  # LISTEN
                found.append(address)
    return found


def test_bytes_that_are_no_request_harm_nothing(host, expected):
    server, s = host
    ch = channel(server)
    try:
        raw = ch.unary_stream("/vllm.grpc.engine.VllmEngine/Generate")  # bytes in, bytes out
        with pytest.raises(grpc.RpcError) as refused:
            list(raw(b"\xff\xff\xff\xff not a GenerateRequest"))
        # grpc's own answer to a message that does not decode (grpcio's aio server: UNKNOWN, naming
        # the DecodeError); the servicer never sees it.
        assert "DecodeError" in refused.value.details(), refused.value
    finally:
        ch.close()
    assert streamed_tokens(s.Generate(generate_request("after-garbage", PROMPT, TOKENS)))[0] == expected
