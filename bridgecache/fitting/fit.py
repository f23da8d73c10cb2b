"""Fit a Bridge in closed form: Full-Head Mapping ("fullhead") or CacheBridge ("cachebridge").

`fit_layer_maps` is the model-free engine: given a way to stream `PairedKV`s (twice at most),
it picks layer support (pass 1: probe statistics, unless support is "depth" and heads need no
matching), builds each target head's inputs, accumulates the maps' statistics (pass 2: with the
target's attention weights for attention-aligned fitting) and solves them.
`fit_bridge` is the model-level entry: calibration text -> sequences -> models -> engine -> Bridge.

Both take one `FitConfig` (bridgecache.bridge.recipe: every option, its default and its range).
Method defaults (each overridable):
    fullhead:    every source KV head of the top-k (k=4) source layers, uniform row weights.
    cachebridge: the matched source head in each of the top-k (k=2) source layers,
                 attention-aligned row weights.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch

from bridgecache.bridge.maps import Bridge, LayerMap
from bridgecache.bridge.recipe import DEFAULT_K, DEFAULT_WEIGHTING, FitConfig
from bridgecache.fitting.calibration import calibration_sequences, same_tokenizer
from bridgecache.fitting.core import LayerAccumulator, PairedKV, Shift, add_probe
from bridgecache.fitting.runner import paired_kv
from bridgecache.fitting.support import (
    ProbeMoments,
    depth_layers,
    full_inputs,
    match_heads,
    score_probes,
    top_layers,
)
from bridgecache.models.fingerprint import weight_fingerprint
from bridgecache.models.spec import model_spec

__all__ = ["fit_bridge", "fit_layer_maps"]

# sequences(with_weights) -> a fresh iterable over the calibration sequences' PairedKV.
SequenceSource = Callable[[bool], Iterable[PairedKV]]


def fit_layer_maps(
    sequences: SequenceSource,
    source_shape: tuple[int, int, int],
    target_shape: tuple[int, int, int],
    config: FitConfig | None = None,
    *,
    device=None,
    probe_sequences: SequenceSource | None = None,
) -> tuple[list[LayerMap], dict]:
    """Fit one LayerMap per target layer from streamed paired KV.

    source_shape, target_shape: (layers, kv_heads, head_dim) of each model.
    config: the solver's settings are read from it (method, layers_k, layer_support, weighting,
        lam, key_scale, stats_precision); the calibration settings belong to whoever streams.
    probe_sequences: what the layer-probe pass streams (default: `sequences`; a subset is cheaper).
    Returns the layer maps and a JSON-able description (layer scores, support, shrinkage).
    """
    config = _checked(config)
    method, lam, key_scale = config.method, config.lam, config.key_scale
    weighting = config.weighting or DEFAULT_WEIGHTING[method]
    k = config.layers_k or DEFAULT_K[method]
    (ls, hs, ds), (lt, ht, dt) = source_shape, target_shape
    info: dict = {
        "method": method,
        "layers_k": k,
        "layer_support": config.layer_support,
        "lam": lam,
        "weighting": weighting,
        "key_scale": key_scale,
    }

    need_heads = method == "cachebridge" and hs != ht
    scores = None
    if config.layer_support == "probe" or need_heads:
        train, heldout = (
            ProbeMoments(ls, hs, ds, lt, ht, dt, device),
            ProbeMoments(ls, hs, ds, lt, ht, dt, device),
        )
        shift = None
        for seq in (probe_sequences or sequences)(False):
            shift = shift or Shift.of(seq)
            add_probe(heldout if seq.heldout else train, shift.apply(seq))
        if heldout.n == 0 or train.n == 0:
            raise ValueError("layer probes need both training and held-out sequences")
        scores = score_probes(train, heldout, lam)
        info["layer_scores"] = [[round(float(x), 4) for x in row] for row in scores.layer]
    support = top_layers(scores.layer, k) if config.layer_support == "probe" else depth_layers(ls, lt, k)
    if method == "fullhead":
        inputs = full_inputs(support, hs, ht)
    else:
        inputs = match_heads(support, hs, ht, None if scores is None else scores.head)

    weighted = weighting == "attention"
    precision = config.stats_precision
    accs = [
        LayerAccumulator(t, inputs[t], hs, ds, dt, weighted, device, precision=precision) for t in range(lt)
    ]
    rows, shift = {"train": 0, "heldout": 0}, None
    for seq in sequences(weighted):
        rows["heldout" if seq.heldout else "train"] += int(seq.tgt_rows.numel())
        shift = shift or Shift.of(seq)
        seq = shift.apply(seq)
        for acc in accs:
            acc.add(seq)
    layers = [acc.solve(lam, shift, key_scale) for acc in accs]
    info["rows"] = rows
    if key_scale == "variance":
        info["key_alpha"] = [[round(float(a), 4) for a in acc.key_alpha] for acc in accs]
        info["r2_key_ridge"] = [round(acc.r2_key_ridge, 4) for acc in accs]
    if weighted:
        info["alpha"] = {kind: [[round(a, 4) for a in acc.alphas[kind]] for acc in accs] for kind in "kv"}
    return layers, info


def fit_bridge(
    source_model,
    target_model,
    source_tokenizer,
    target_tokenizer,
    config: FitConfig | None = None,
    *,
    progress: bool = True,
    source_name: str | None = None,
    target_name: str | None = None,
) -> Bridge:
    """Fit a Bridge from `source_model` to `target_model` on calibration text.

    config: how (a `FitConfig`; None: `FitConfig()`, Full-Head Mapping on 32 x 256 tokens of prose).
        It is recorded in `bridge.calibration["recipe"]`; `layers_k` is checked against the source.
    progress: progress bars on stderr.
    source_name, target_name: the models' names in the bridge and its recipe (default: the path
        or hub id they were loaded from); `bridgecache fit --recipe` loads the models by them.
    """
    c = _checked(config)
    source_spec = model_spec(source_model, source_tokenizer, name=source_name)
    target_spec = model_spec(target_model, target_tokenizer, name=target_name)
    c.check_against(source_spec)
    tokenizers_match = same_tokenizer(source_tokenizer, target_tokenizer)
    if c.identity_if_same and tokenizers_match and _same_weights(source_model, target_model):
        bridge = Bridge.identity(target_spec, native_head=c.native_head)
        bridge.calibration = {"description": "exact identity: the same model on both sides; no regression"}
        return bridge

    seqs, policy = calibration_sequences(
        source_tokenizer, target_tokenizer, c.num_sequences, c.seq_len, c.domain, c.alignment_policy,
        c.native_head, c.heldout_every, c.seed,
    )  # fmt: skip

    def sequences(with_weights: bool):
        return paired_kv(
            source_model, target_model, seqs, with_weights, c.boundaries, c.native_head, progress, "fit"
        )

    probe_seqs = seqs if c.probe_subset is None else seqs[: c.probe_subset]
    if not any(s.heldout for s in probe_seqs):
        probe_seqs = probe_seqs + [next(s for s in seqs if s.heldout)]

    def probes(with_weights: bool):
        return paired_kv(
            source_model, target_model, probe_seqs, False, c.boundaries, c.native_head, progress, "probes"
        )

    device = target_model.get_input_embeddings().weight.device
    layers, info = fit_layer_maps(
        sequences,
        (source_spec.num_layers, source_spec.num_kv_heads, source_spec.head_dim),
        (target_spec.num_layers, target_spec.num_kv_heads, target_spec.head_dim),
        c,
        device=device,
        probe_sequences=probes,
    )
    calibration = {
        "text": "bridgecache.text",
        "domain": c.domain,
        "split": "calib",
        "num_sequences": c.num_sequences,
        "seq_len": c.seq_len,
        "seed": c.seed,
        "heldout_every": c.heldout_every,
        "boundaries": c.boundaries if info["weighting"] == "attention" else None,
        "probe_sequences": len(probe_seqs) if "layer_scores" in info else 0,
        **info,
        # Exactly the config this call was given: `bridgecache fit --recipe` fits again from it.
        "recipe": c.recipe(source_spec.name, target_spec.name),
    }
    fingerprints = {"source": weight_fingerprint(source_model), "target": weight_fingerprint(target_model)}
    bridge = Bridge(
        source_spec, target_spec, c.method, policy, layers, c.native_head, calibration, fingerprints
    )
    if c.score_heldout:
        from bridgecache.fitting.heldout import score_bridge

        score_bridge(bridge, source_model, target_model, source_tokenizer, target_tokenizer, progress)
    return bridge


def _checked(config) -> FitConfig:
    """`config`, or FitConfig() for None."""
    if config is None:
        return FitConfig()
    if not isinstance(config, FitConfig):  # e.g. the method as a string, as before FitConfig
        raise TypeError(f"config is {config!r}; expected a FitConfig, e.g. FitConfig(method='fullhead')")
    return config


def _same_weights(a, b) -> bool:
    """The same model object, or two models with equal specs and bit-identical parameters."""
    if a is b:
        return True
    if model_spec(a).mismatches(model_spec(b)):
        return False
    pa, pb = dict(a.named_parameters()), dict(b.named_parameters())
    return pa.keys() == pb.keys() and all(torch.equal(pa[n], pb[n].to(pa[n].device)) for n in pa)
