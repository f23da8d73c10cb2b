"""Runtime: a bridged cache and the handoffs built on it.

Knows bridges, KV and transformers' caches and models; nothing about fitting or evaluation.
"""
