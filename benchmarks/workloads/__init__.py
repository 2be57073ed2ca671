"""The evaluation's request traces: the paper's (``traces``), hot contexts, multi-turn sessions,
the chat service, a trace file of one's own, and the sharing profile of any of them."""
