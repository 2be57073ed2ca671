"""``lmpool serve --grpc-port``: the pool as an engine of smg's gRPC protocol (``vllm_engine.proto``)."""
