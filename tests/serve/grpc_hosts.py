"""``lmpool serve --grpc-port`` hosts for the tests, and a plain gRPC client of smg's engine protocol."""

from __future__ import annotations

from pathlib import Path

import grpc
from serve_process import ServerProcess, free_ports, start_servers
from smg_grpc_proto.generated import common_pb2, vllm_engine_pb2, vllm_engine_pb2_grpc

pb = vllm_engine_pb2


def start_grpc_hosts(n: int, model: str, tmp: Path, *args: str) -> list[ServerProcess]:
    """``n`` servers, each with ``grpc_port`` and ``grpc_url`` set, ready (``/health`` answers
    once the pool and the gRPC server are up)."""
    ports = free_ports(n)
    servers = start_servers(n, model, tmp, *args, grpc_ports=ports)
    for server, port in zip(servers, ports):
        server.grpc_port = port
        server.grpc_url = f"grpc://127.0.0.1:{port}"
    return servers


def channel(server: ServerProcess) -> grpc.Channel:
    return grpc.insecure_channel(f"127.0.0.1:{server.grpc_port}")


def stub(ch: grpc.Channel) -> vllm_engine_pb2_grpc.VllmEngineStub:
    return vllm_engine_pb2_grpc.VllmEngineStub(ch)


def generate_request(request_id: str, ids: list[int], max_tokens: int, stream: bool = True, **sampling):
    params = pb.SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **sampling)
    return pb.GenerateRequest(request_id=request_id, tokenized=pb.TokenizedInput(input_ids=ids),
                              sampling_params=params, stream=stream)


def streamed_tokens(responses) -> tuple[list[int], object]:
    """The tokens of a streamed ``Generate`` (its chunks), and its ``GenerateComplete``."""
    tokens, complete = [], None
    for response in responses:
        if response.HasField("chunk"):
            tokens.extend(response.chunk.token_ids)
        else:
            complete = response.complete
    return tokens, complete


def subscribe(s, start: int = 0):
    return s.SubscribeKvEvents(common_pb2.SubscribeKvEventsRequest(start_sequence_number=start))


def loads(s):
    return s.GetLoads(pb.GetLoadsRequest()).loads
