"""Decoding with the target outside training: the continuous-batching engine (engine.py), dataset regeneration
(regenerate.py), the prompts the target writes itself (self_prompts.py) and data.regenerate for a run (run_data.py)."""
