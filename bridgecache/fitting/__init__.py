"""Closed-form fitting of bridges: Full-Head Mapping and CacheBridge.

Modules, one job each:
    stats        streaming (weighted) sufficient statistics, float64
    ridge        ridge solve on centred statistics, held-out R^2
    support      layer support (probe scores, relative depth) and head matching
    attention    attention-aligned token weights from the target's own attention
    calibration  calibration token sequences and the (source row, target row) pairing
    runner       run both models over the calibration sequences -> PairedKV
    core         per-target-layer accumulation and solve (model- and tokenizer-free)
    fit          fit_layer_maps (engine) and fit_bridge (models -> Bridge)
    cli          the `bridgecache fit` subcommand
"""

from bridgecache.fitting.core import PairedKV
from bridgecache.fitting.fit import DEFAULT_K, DEFAULT_WEIGHTING, fit_bridge, fit_layer_maps
from bridgecache.fitting.ridge import DEFAULT_LAM

__all__ = ["fit_bridge", "fit_layer_maps", "PairedKV", "DEFAULT_K", "DEFAULT_WEIGHTING", "DEFAULT_LAM"]
