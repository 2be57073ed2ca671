"""Running a trace against a pool: the replay and its arrival process (``eval_driver``), and
the settings a suite sweeps (``eval_settings``: KV budget, window, arrival)."""
