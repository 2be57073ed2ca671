"""The KV-transfer benchmark's pool path (``kv_transfer_pool``, run by ``benchmark_kv_transfer
--kind pool``) and what both share (``record``: the KV block's shape, the percentile, the
machine a run records), so neither imports the other's runner."""
