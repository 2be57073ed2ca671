"""The device machine's side of the benchmarks: its shell scripts (``setup.sh``, ``run_*.sh``),
Dynamo's wheel carry (``pack_dynamo``), and the MPS daemon the evaluation runs under (``mps``)."""
