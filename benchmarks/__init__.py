"""LMPool's benchmarks and evaluation suite, run from the repository root as modules
(``python -m benchmarks.benchmark_e2e --quick``; ``README.md`` here lists them all).

The runners a user calls sit at this level; what they share lives in subpackages by concept:
``workloads`` (request traces and their profiles), ``peers`` (the routing policies and the
external routers they are compared with), ``replay`` (driving a trace against a pool, under a
setting), ``stats`` (intervals, metrics, claims, the policy order), ``transfer`` (the KV-transfer
benchmark's pool path and what it shares with the benchmark), ``device`` (the device machine's
scripts and the MPS daemon), ``lib`` (the revision record and progress bars every runner uses).
"""
