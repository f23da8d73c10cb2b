"""KV: a context's keys and values, and how they line up between two models.

    source    SourceKV (the one KV container), as_source, save_kv / load_kv
    capture   capture_kv: run a model over token ids and keep every layer's KV
    rope      rotary tables from a model's own rotary module; rotate / unrotate
    keynorm   mapped keys on the norm a target's k_norm produces
    align     the tokenalign seam: gather source rows through an Alignment
    rows      row planning: which source row feeds each target context column

Knows models and tokenalign; nothing about bridges' maps or caches.
"""
