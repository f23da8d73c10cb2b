"""Bridges: per-layer affine maps from a source model's KV to a target model's, as files to share.

    maps      Bridge and LayerMap
    storage   a bridge directory: written atomically, read and checked (safetensors + JSON, never pickle)
    format    validation of `bridge.json`: every field's type and range
    resolve   what `Bridge.from_pretrained` was given -> a local bridge directory
    builtin   bridges shipped inside the package, their model fingerprints, model checks
    export    ship a fitted bridge inside the package (float16)
    recipe    FitConfig: how a bridge is fitted, recorded in it as its recipe
    hub       download from / upload to the Hugging Face Hub
    card      README.md with YAML front matter beside every saved bridge
    summary   repr, notebook markdown, the `inspect` report and its plot

Knows models' identities (bridgecache.models) and the options of a fit (recipe); nothing about
KV, caches or how a fit computes.
"""

from bridgecache.bridge.maps import Bridge, BridgeFormatError, LayerMap, WeightMismatchWarning
from bridgecache.bridge.storage import tensors_path

__all__ = ["Bridge", "BridgeFormatError", "LayerMap", "WeightMismatchWarning", "tensors_path"]
