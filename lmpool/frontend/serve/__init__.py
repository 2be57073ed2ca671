"""``lmpool serve``: one pool behind an OpenAI-compatible HTTP API (FastAPI on uvicorn), and the
publisher of its KV events in vLLM's format. Needs the ``serve`` extra."""
