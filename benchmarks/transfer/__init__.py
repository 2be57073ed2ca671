"""The KV-transfer benchmark's pool path (``kv_transfer_pool``), run by
``benchmark_kv_transfer --kind pool``."""
