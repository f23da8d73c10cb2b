"""bridgecache.kernels: mapping, statistics and attention kernels (Triton on CUDA, PyTorch elsewhere).

- `map_heads(src, rows, heads, weight, bias, ...)`: head-local map of one target layer.
- `map_layers(src_layers, rows, heads, weight, bias, ...)`: the same for every layer, one launch.
- `map_fullhead(src, rows, weight, bias, ...)`: every target head reads all source heads.
- `SufficientStats` / `accumulate_stats`: weighted ridge statistics without materialising X.
- `column_attention(query, key, value, query_columns, key_columns, first_column, ...)`: attention
  of queries at scattered context columns to the keys up to each one's column (block-skipping).
- `use_backend("torch")`: a block whose kernel calls (this thread only) take that backend.

Keys are un-rotated and re-rotated in each side's rotary layout (`src_rotary=`, `tgt_rotary=`: a
plain (kind, rotary_dim) pair, half-split or interleaved pairs over the head's leading channels;
`kernels.rotary`), a compile-time constant of the Triton kernels.

Ships as `bridgecache.kernels` (the folder `kernels/` at the repository top). Knows nothing about
models, tokenizers, caches or bridges, and imports nothing else from bridgecache.

Python started in the repository root (a REPL, `python -c`, a notebook) also finds this folder
as a top-level `kernels`: the name of Hugging Face's kernel hub package, which transformers
imports. Imported under that name, this file runs none of our code: it hands the name to Hugging
Face's package where one is installed, else leaves what a folder without `__init__.py` would be
(an empty namespace: no `__file__`, no `__version__`, which transformers reads as "not installed").
"""


def _give_way() -> None:
    """sys.modules["kernels"] (what the import system returns for this import, once this file has
    run): Hugging Face's `kernels`, found on sys.path without this repository's root, or an empty
    stand-in whose attributes say that none is installed."""
    import os
    import sys
    import types
    from importlib.machinery import ModuleSpec, PathFinder
    from importlib.util import module_from_spec

    root = os.path.dirname(os.path.dirname(os.path.realpath(__file__)))
    path = [entry for entry in sys.path if os.path.realpath(entry or os.curdir) != root]
    spec = PathFinder.find_spec("kernels", path)
    if spec is not None:
        module = sys.modules["kernels"] = module_from_spec(spec)
        spec.loader.exec_module(module)  # on failure the import system drops the name and raises
        return

    def missing(name):
        raise AttributeError(
            f"module 'kernels' has no attribute {name!r}: Hugging Face's kernels package is not "
            f"installed (pip install kernels), and {root}/kernels is bridgecache's own folder "
            "(import it as bridgecache.kernels)"
        )

    stand_in = types.ModuleType("kernels", "Hugging Face's kernels is not installed (see __getattr__).")
    stand_in.__spec__ = ModuleSpec("kernels", None)  # origin None: find_spec's answer once imported
    stand_in.__getattr__ = missing  # no __file__, __version__ or __path__: kernels.x does not import
    sys.modules["kernels"] = stand_in


if __name__ == "kernels":  # the repository root is on sys.path: this folder is not that package
    _give_way()
else:
    from ._dispatch import use_backend
    from .attention import column_attention
    from .map_fullhead import map_fullhead
    from .map_heads import map_heads, map_layers
    from .stats import SufficientStats, accumulate_stats

__all__ = [
    "SufficientStats",
    "accumulate_stats",
    "column_attention",
    "map_fullhead",
    "map_heads",
    "map_layers",
    "use_backend",
]
