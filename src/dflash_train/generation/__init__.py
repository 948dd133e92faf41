"""Decoding with the target outside training: the continuous-batching engine (engine.py) and the prompts the target
writes itself (self_prompts.py)."""
