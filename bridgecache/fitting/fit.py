"""Fit a Bridge in closed form: Full-Head Mapping ("fullhead") or CacheBridge ("cachebridge").

`fit_layer_maps` is the model-free engine: given a way to stream `PairedKV`s (twice at most),
it picks layer support (pass 1: probe statistics, unless support is "depth" and heads need no
matching), builds each target head's inputs, accumulates the maps' statistics (pass 2: with the
target's attention weights for attention-aligned fitting) and solves them.
`fit_bridge` is the model-level entry: calibration text -> sequences -> models -> engine -> Bridge.

Method defaults (each overridable):
    fullhead:    every source KV head of the top-k (k=4) source layers, uniform row weights.
    cachebridge: the matched source head in each of the top-k (k=2) source layers,
                 attention-aligned row weights.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch

from bridgecache.bridge.maps import Bridge, LayerMap
from bridgecache.fitting.calibration import calibration_sequences, same_tokenizer
from bridgecache.fitting.core import LayerAccumulator, PairedKV, Shift, add_probe
from bridgecache.fitting.options import check_fit_options
from bridgecache.fitting.ridge import DEFAULT_LAM
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

__all__ = [
    "fit_bridge",
    "fit_layer_maps",
    "DEFAULT_K",
    "DEFAULT_WEIGHTING",
    "DEFAULT_KEY_SCALE",
    "KEY_SCALES",
]

DEFAULT_K = {"fullhead": 4, "cachebridge": 2}
DEFAULT_WEIGHTING = {"fullhead": "uniform", "cachebridge": "attention"}
KEY_SCALES = ("variance", "none")
DEFAULT_KEY_SCALE = "variance"
SUPPORTS = ("probe", "depth")

# sequences(with_weights) -> a fresh iterable over the calibration sequences' PairedKV.
SequenceSource = Callable[[bool], Iterable[PairedKV]]


def fit_layer_maps(
    sequences: SequenceSource,
    source_shape: tuple[int, int, int],
    target_shape: tuple[int, int, int],
    method: str = "cachebridge",
    layers_k: int | None = None,
    layer_support: str = "probe",
    lam: float = DEFAULT_LAM,
    weighting: str | None = None,
    device=None,
    probe_sequences: SequenceSource | None = None,
    key_scale: str = DEFAULT_KEY_SCALE,
    stats_precision: str = "tf32x3",
) -> tuple[list[LayerMap], dict]:
    """Fit one LayerMap per target layer from streamed paired KV.

    source_shape, target_shape: (layers, kv_heads, head_dim) of each model.
    probe_sequences: what the layer-probe pass streams (default: `sequences`; a subset is cheaper).
    key_scale: "variance" stretches key predictions to the target keys' spread, "none" keeps
        the ridge solution (see bridgecache.fitting.ridge).
    stats_precision: the products of the fused statistics kernel on CUDA ("tf32x3", about
        float32; "tf32" or "bf16", faster and less exact: benchmarks/reports/gpu-kernels.md has the
        error and speed of each). The CPU path computes in float64 whatever it says.
    Returns the layer maps and a JSON-able description (layer scores, support, shrinkage).
    """
    if method not in DEFAULT_K:
        raise ValueError(f"unknown method {method!r}; expected 'fullhead' or 'cachebridge'")
    if layer_support not in SUPPORTS:
        raise ValueError(f"unknown layer support {layer_support!r}; expected one of {SUPPORTS}")
    if key_scale not in KEY_SCALES:
        raise ValueError(f"unknown key_scale {key_scale!r}; expected one of {KEY_SCALES}")
    weighting = weighting or DEFAULT_WEIGHTING[method]
    if weighting not in ("uniform", "attention"):
        raise ValueError(f"unknown weighting {weighting!r}; expected 'uniform' or 'attention'")
    k = layers_k or DEFAULT_K[method]
    (ls, hs, ds), (lt, ht, dt) = source_shape, target_shape
    info: dict = {
        "method": method,
        "layers_k": k,
        "layer_support": layer_support,
        "lam": lam,
        "weighting": weighting,
        "key_scale": key_scale,
    }

    need_heads = method == "cachebridge" and hs != ht
    scores = None
    if layer_support == "probe" or need_heads:
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
    support = top_layers(scores.layer, k) if layer_support == "probe" else depth_layers(ls, lt, k)
    if method == "fullhead":
        inputs = full_inputs(support, hs, ht)
    else:
        inputs = match_heads(support, hs, ht, None if scores is None else scores.head)

    weighted = weighting == "attention"
    accs = [
        LayerAccumulator(t, inputs[t], hs, ds, dt, weighted, device, precision=stats_precision)
        for t in range(lt)
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
    method: str = "cachebridge",
    *,
    num_sequences: int = 32,
    seq_len: int = 256,
    domain: str = "prose",
    layers_k: int | None = None,
    layer_support: str = "probe",
    lam: float = DEFAULT_LAM,
    weighting: str | None = None,
    alignment_policy: str | None = None,
    key_scale: str = DEFAULT_KEY_SCALE,
    native_head: int = 1,
    heldout_every: int = 8,
    boundaries: int = 32,
    probe_subset: int | None = 16,
    identity_if_same: bool = True,
    progress: bool = True,
    seed: int = 0,
    source_name: str | None = None,
    target_name: str | None = None,
    score_heldout: bool = True,
    stats_precision: str = "tf32x3",
) -> Bridge:
    """Fit a Bridge from `source_model` to `target_model` on calibration text.

    Args:
        method: "fullhead" or "cachebridge".
        num_sequences, seq_len, domain, seed: calibration data (bridgecache.text "calib" split;
            domain "prose", "code" or "mixed"); every `heldout_every`-th sequence scores the maps.
        layers_k: source layers per target layer (method default: DEFAULT_K).
        layer_support: "probe" (held-out R^2 of single-layer probes) or "depth" (relative depth).
        lam: ridge strength relative to the data scale (see bridgecache.fitting.ridge).
        weighting: "uniform" or "attention" (method default: DEFAULT_WEIGHTING).
        alignment_policy: tokenalign policy across tokenizers (default "last").
        key_scale: "variance" (stretch key predictions to the target keys' spread) or "none".
        native_head: target positions [0, native_head) are computed natively, never fitted.
        boundaries: prefix boundaries of the attention weights.
        probe_subset: layer probes read only the first this many sequences (plus a held-out one
            if none is among them): the probe pass costs a forward of both models per sequence.
            None: all.
        identity_if_same: the same model on both sides gives the exact identity bridge.
        score_heldout: measure attention-output cosine per target layer on the held-out
            sequences (bridgecache.fitting.heldout; what the quality gate reads).
        stats_precision: products of the fused statistics kernel on CUDA (see fit_layer_maps).
    """
    source_spec = model_spec(source_model, source_tokenizer, name=source_name)
    target_spec = model_spec(target_model, target_tokenizer, name=target_name)
    check_fit_options(
        method=method,
        num_sequences=num_sequences,
        seq_len=seq_len,
        domain=domain,
        layers_k=layers_k,
        lam=lam,
        alignment_policy=alignment_policy,
        native_head=native_head,
        heldout_every=heldout_every,
        source_layers=source_spec.num_layers,
        stats_precision=stats_precision,
    )
    tokenizers_match = same_tokenizer(source_tokenizer, target_tokenizer)
    if identity_if_same and tokenizers_match and _same_weights(source_model, target_model):
        bridge = Bridge.identity(target_spec, native_head=native_head)
        bridge.calibration = {"description": "exact identity: the same model on both sides; no regression"}
        return bridge

    seqs, policy = calibration_sequences(
        source_tokenizer, target_tokenizer, num_sequences, seq_len, domain, alignment_policy, native_head,
        heldout_every, seed,
    )  # fmt: skip

    def sequences(with_weights: bool):
        return paired_kv(
            source_model, target_model, seqs, with_weights, boundaries, native_head, progress, "fit"
        )

    probe_seqs = seqs if probe_subset is None else seqs[:probe_subset]
    if not any(s.heldout for s in probe_seqs):
        probe_seqs = probe_seqs + [next(s for s in seqs if s.heldout)]

    def probes(with_weights: bool):
        return paired_kv(
            source_model, target_model, probe_seqs, False, boundaries, native_head, progress, "probes"
        )

    device = target_model.get_input_embeddings().weight.device
    layers, info = fit_layer_maps(
        sequences,
        (source_spec.num_layers, source_spec.num_kv_heads, source_spec.head_dim),
        (target_spec.num_layers, target_spec.num_kv_heads, target_spec.head_dim),
        method, layers_k, layer_support, lam, weighting, device, probes, key_scale,
        stats_precision=stats_precision,
    )  # fmt: skip
    calibration = {
        "text": "bridgecache.text",
        "domain": domain,
        "split": "calib",
        "num_sequences": num_sequences,
        "seq_len": seq_len,
        "seed": seed,
        "heldout_every": heldout_every,
        "boundaries": boundaries if info["weighting"] == "attention" else None,
        "probe_sequences": len(probe_seqs) if "layer_scores" in info else 0,
        **info,
        # Exactly what this call was given: `bridgecache fit --recipe` regenerates the maps from it.
        "recipe": {
            "source": source_spec.name,
            "target": target_spec.name,
            "method": method,
            "num_sequences": num_sequences,
            "seq_len": seq_len,
            "domain": domain,
            "layers_k": layers_k,
            "layer_support": layer_support,
            "lam": lam,
            "weighting": weighting,
            "alignment_policy": alignment_policy,
            "key_scale": key_scale,
            "native_head": native_head,
            "heldout_every": heldout_every,
            "boundaries": boundaries,
            "probe_subset": probe_subset,
            "stats_precision": stats_precision,
            "identity_if_same": identity_if_same,
            "seed": seed,
        },
    }
    fingerprints = {"source": weight_fingerprint(source_model), "target": weight_fingerprint(target_model)}
    bridge = Bridge(source_spec, target_spec, method, policy, layers, native_head, calibration, fingerprints)
    if score_heldout:
        from bridgecache.fitting.heldout import score_bridge

        score_bridge(bridge, source_model, target_model, source_tokenizer, target_tokenizer, progress)
    return bridge


def _same_weights(a, b) -> bool:
    """The same model object, or two models with equal specs and bit-identical parameters."""
    if a is b:
        return True
    if model_spec(a).mismatches(model_spec(b)):
        return False
    pa, pb = dict(a.named_parameters()), dict(b.named_parameters())
    return pa.keys() == pb.keys() and all(torch.equal(pa[n], pb[n].to(pa[n].device)) for n in pa)
