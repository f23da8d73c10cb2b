"""Bridges as files people share: shipped built-ins, the Hub, bridge cards, inspection.

Modules, one job each:
    resolve   what `Bridge.from_pretrained` was given -> a local bridge directory
    builtin   bridges shipped inside the package (float16), their model fingerprints, export
    recipe    the fit arguments a bridge records, and fitting again from them
    hub       download from / upload to the Hugging Face Hub (through huggingface_hub)
    card      README.md with YAML front matter, written beside every saved bridge
    summary   repr, notebook markdown, the `inspect` report and its plot
    cli       the `inspect` and `export-builtin` subcommands

Knows bridges, the zoo's pinned model files and huggingface_hub; nothing about caches or KV.
"""
