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
"""

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
