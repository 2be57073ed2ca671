"""The device machine's side of the benchmarks: its shell scripts (``setup.sh``, ``run_*.sh``),
the wheel carries of Dynamo (``pack_dynamo``) and smg (``pack_serve``), and the MPS daemon the
evaluation runs under (``mps``)."""
