"""Closed-form fitting of bridges: Full-Head Mapping and CacheBridge.

Modules, one job each:
    stats        streaming (weighted) sufficient statistics, float64
    ridge        ridge solve on centred statistics, held-out R^2
    support      layer support (probe scores, relative depth) and head matching
    attention    attention-aligned token weights from the target's own attention
    calibration  calibration token sequences and the (source row, target row) pairing
    runner       run both models over the calibration sequences, in batches -> PairedKV
    core         per-target-layer accumulation and solve (model- and tokenizer-free)
    gram         float64 GEMM statistics: Full-Head's distinct blocks once, a group's heads stacked
    group        one statistics pass over a group of target layers; the groups within the budget
    fit          fit_layer_maps (engine) and fit_bridge (models -> Bridge)
    heldout      attention-output cosine of a bridge on its held-out sequences
    refit        fit again from a bridge's recorded recipe
    cached       a bridge per (models, FitConfig), fitted on first use and cached on disk
    options      whether a model reference can possibly load (for the commands)

The options of a fit are one `FitConfig` (defined with the recipe a bridge records of it, in
bridgecache.bridge.recipe, since every bridge file carries one).
"""

from bridgecache.bridge.recipe import DEFAULT_K, DEFAULT_WEIGHTING, FitConfig
from bridgecache.fitting.core import PairedKV
from bridgecache.fitting.fit import fit_bridge, fit_layer_maps
from bridgecache.fitting.ridge import DEFAULT_LAM

__all__ = [
    "FitConfig",
    "fit_bridge",
    "fit_layer_maps",
    "PairedKV",
    "DEFAULT_K",
    "DEFAULT_WEIGHTING",
    "DEFAULT_LAM",
]
