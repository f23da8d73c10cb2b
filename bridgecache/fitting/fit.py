"""Fit a Bridge in closed form: Full-Head Mapping ("fullhead") or CacheBridge ("cachebridge").

`fit_layer_maps` is the model-free engine: given a way to stream `PairedKV`s, it picks layer
support (pass 1: probe rows and scores, unless support is "depth" and heads need no matching),
builds each target head's inputs, accumulates the maps' statistics (pass 2: with the target's
attention weights for attention-aligned fitting; more passes, each over a group of target layers,
only when all layers' statistics together exceed the memory budget) and solves them.
`fit_bridge` is the model-level entry: calibration text -> sequences -> models -> engine -> Bridge.

Both take one `FitConfig` (bridgecache.bridge.recipe: every option, its default and its range).
Method defaults (each overridable):
    fullhead:    every source KV head of the top-k (k=4) source layers, uniform row weights.
    cachebridge: the matched source head in each of the top-k (k=2) source layers,
                 attention-aligned row weights.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable
from dataclasses import replace

import torch
from tqdm.auto import tqdm

from bridgecache.bridge.maps import Bridge, LayerMap
from bridgecache.bridge.recipe import DEFAULT_K, DEFAULT_WEIGHTING, FitConfig, FitOptionError
from bridgecache.fitting.calibration import calibration_sequences, same_tokenizer
from bridgecache.fitting.core import LayerAccumulator, PairedKV, Shift, add_probe
from bridgecache.fitting.group import (
    GroupStatistics,
    gram_path,
    layer_groups,
    shared_groups,
    shared_supports,
    statistics_label,
)
from bridgecache.fitting.phases import PhaseClock
from bridgecache.fitting.runner import paired_kv
from bridgecache.fitting.support import (
    ProbeRows,
    ProbeScores,
    depth_layers,
    full_inputs,
    match_heads,
    score_probes,
    top_layers,
)
from bridgecache.models.fingerprint import weight_fingerprint
from bridgecache.models.spec import model_spec
from bridgecache.text import Digest, UserText

__all__ = ["fit_bridge", "fit_layer_maps", "calibration_batch"]

# sequences(with_weights) -> a fresh iterable over the calibration sequences' PairedKV (called
# once for the probes and once per statistics pass: more than one pass only when the statistics
# of every target layer at once exceed the memory budget).
SequenceSource = Callable[[bool], Iterable[PairedKV]]

_GiB = 2**30


def fit_layer_maps(
    sequences: SequenceSource,
    source_shape: tuple[int, int, int],
    target_shape: tuple[int, int, int],
    config: FitConfig | None = None,
    *,
    device=None,
    probe_sequences: SequenceSource | None = None,
    probe_dtype: torch.dtype = torch.float32,
    clock: PhaseClock | None = None,
    progress: bool = False,
) -> tuple[list[LayerMap], dict]:
    """Fit one LayerMap per target layer from streamed paired KV.

    source_shape, target_shape: (layers, kv_heads, head_dim) of each model.
    config: the solver's settings are read from it (method, layers_k, layer_support, weighting,
        lam, key_scale, stats_precision, memory_budget_gb); the calibration settings belong to
        whoever streams.
    device: where the statistics live (every PairedKV is moved there once).
    probe_sequences: what the layer-probe pass streams (default: `sequences`; a subset is cheaper).
    probe_dtype: the precision the probe rows are kept in (the models' own is enough).
    clock: collects seconds and tokens per phase (bridgecache.fitting.phases), if given.
    Returns the layer maps and a JSON-able description (layer scores, support, shrinkage).
    """
    config = _checked(config)
    clock = clock or PhaseClock(device)
    method, lam, key_scale = config.method, config.lam, config.key_scale
    weighting = config.weighting or DEFAULT_WEIGHTING[method]
    k = config.layers_k or DEFAULT_K[method]
    (ls, hs, ds), (lt, ht, dt) = source_shape, target_shape
    budget = memory_budget(config, device)
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
        scores = _probe_scores(
            probe_sequences or sequences,
            (ls, hs, ds, lt, ht, dt),
            lam,
            device,
            probe_dtype,
            budget,
            clock,
            progress,
            config.stats_precision,
            heads=need_heads,  # only head matching reads the single-head probes
        )
        info["layer_scores"] = [[round(float(x), 4) for x in row] for row in scores.layer]
    support = top_layers(scores.layer, k) if config.layer_support == "probe" else depth_layers(ls, lt, k)
    if method == "fullhead":
        inputs = full_inputs(support, hs, ht)
    else:
        inputs = match_heads(support, hs, ht, None if scores is None else scores.head)

    weighted = weighting == "attention"
    supports = shared_supports(inputs, hs) if gram_path(weighted, config.stats_precision) else None
    if supports:  # two splits x two kinds of shared blocks
        groups = shared_groups(supports, hs * ds, ht * dt, 4, budget)
    else:
        groups = layer_groups(inputs, hs, ds, dt, weighted, budget)
    info["statistics_passes"] = len(groups)
    info["statistics"] = statistics_label(supports is not None, config.stats_precision)
    layers: list[LayerMap] = []
    rows, accs_done = {"train": 0, "heldout": 0}, []
    for number, group in enumerate(groups, 1):
        shape = (hs, ds, ht, dt)
        stats = GroupStatistics(group, inputs, supports, shape, weighted, device, config.stats_precision)
        rows = {"train": 0, "heldout": 0}
        shift = None
        clock.passes += 1
        stream = clock.timed(sequences(weighted), "forwards", lambda seq: seq.num_rows)
        for seq in stream:
            rows["heldout" if seq.heldout else "train"] += seq.num_rows
            with clock.phase("statistics", seq.num_rows):
                seq = _on(seq, device)
                shift = shift or Shift.of(seq)
                stats.add(shift.apply(seq))
        with clock.phase("solve"):
            desc = f"solve {number}/{len(groups)}"
            bar = tqdm(total=len(group), desc=desc, unit="layer", disable=not progress)
            for acc in stats.accumulators():
                layers.append(acc.solve(lam, shift, key_scale))
                accs_done.append(_summary(acc, key_scale, weighted))
                bar.update()
            bar.close()
        del stats  # this group's statistics are freed before the next pass
    info["rows"] = rows
    if key_scale == "variance":
        info["key_alpha"] = [a["key_alpha"] for a in accs_done]
        info["r2_key_ridge"] = [a["r2_key_ridge"] for a in accs_done]
    if weighted:
        info["alpha"] = {kind: [a["alpha"][kind] for a in accs_done] for kind in "kv"}
    return layers, info


def _probe_scores(
    sequences, shape, lam, device, dtype, budget, clock, progress, precision, heads: bool
) -> ProbeScores:
    """Pass 1: keep the probe sequences' rows within the budget, then score every layer pair."""
    train, heldout = (ProbeRows(*shape, device, dtype, precision) for _ in range(2))
    per_row = ProbeRows.bytes_per_row(*shape, torch.empty((), dtype=dtype).element_size())
    shift = None
    clock.passes += 1
    for seq in clock.timed(sequences(False), "forwards", lambda seq: seq.num_rows):
        with clock.phase("probes", seq.num_rows):
            seq = _on(seq, device)
            shift = shift or Shift.of(seq)
            add_probe(heldout if seq.heldout else train, shift.apply(seq))
            rows = train.n + heldout.n
            need = rows * per_row + ProbeRows.moment_bytes(*shape, rows)
            if budget is not None and need > budget:
                raise MemoryError(
                    f"layer probes: {rows} rows so far need {need / _GiB:.1f} GiB, over the "
                    f"memory budget of {budget / _GiB:.1f} GiB; lower probe_subset or raise memory_budget_gb"
                )
    if heldout.n == 0 or train.n == 0:
        raise ValueError("layer probes need both training and held-out sequences")
    with clock.phase("probes"):
        bar = tqdm(total=shape[0], desc="probe scores", unit="layer", disable=not progress)
        scores = score_probes(train, heldout, lam, progress=bar.update, heads=heads)
        bar.close()
    return scores


def memory_budget(config: FitConfig, device) -> int | None:
    """Bytes the fit's own buffers may take: config.memory_budget_gb, else on CUDA 90% of what is
    free (PyTorch's cached blocks counted free) less one batch's forwards and KV (1 GiB plus
    `batch_kv_bytes`), at least half of what is free; else None (no limit)."""
    if config.memory_budget_gb is not None:
        return int(config.memory_budget_gb * _GiB)
    free = _free_bytes(device)
    if free is None:
        return None
    return max(int(0.9 * free) - _GiB - batch_kv_bytes(device, free), free // 2)


def _free_bytes(device) -> int | None:
    """Bytes free on a CUDA `device`, PyTorch's cached blocks counted free; None elsewhere."""
    device = torch.device(device) if device is not None else torch.device("cpu")
    if device.type != "cuda":
        return None
    free, _ = torch.cuda.mem_get_info(device)
    return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)


_BATCH_TOKENS = 8192  # target tokens per forward: enough to keep a GPU's kernels busy
_BATCH_KV_BYTES = 3 * _GiB  # the least a batch's KV (as captured, un-rotated and shifted) may take


def batch_kv_bytes(device, free: int | None = None) -> int:
    """Bytes one batch's KV may take: 3 GiB, or on CUDA a quarter of what is free (`free`, when the
    caller has it) when more. On an H100, Qwen3-14B -> 32B at half depth read 1,024-token sequences
    11% faster 8 to a forward than 2 (benchmarks/reports/fit-gpu-2026-12-07.md)."""
    free = _free_bytes(device) if free is None else free
    return _BATCH_KV_BYTES if free is None else max(_BATCH_KV_BYTES, free // 4)


def calibration_batch(
    config: FitConfig, source_spec, target_spec, source_tokens: int | None = None, kv_bytes: int | None = None
) -> int:
    """Sequences per forward: config.batch_sequences, else as many as make about 8,192 target
    tokens whose KV (both models' keys and values: as captured, in float32, and shifted, 10 bytes
    a value) stay within `kv_bytes` (default 3 GiB; `batch_kv_bytes`); at least 1.
    source_tokens: the longest source sequence (across tokenizers the source may read more
    tokens than seq_len; default seq_len)."""
    if config.batch_sequences is not None:
        return config.batch_sequences
    width = lambda spec: spec.num_layers * spec.num_kv_heads * spec.head_dim  # noqa: E731
    tokens = source_tokens or config.seq_len
    per_sequence = 2 * 10 * (tokens * width(source_spec) + config.seq_len * width(target_spec))
    return max(1, min(_BATCH_TOKENS // config.seq_len, (kv_bytes or _BATCH_KV_BYTES) // per_sequence))


def _on(seq: PairedKV, device) -> PairedKV:
    """`seq` with every tensor on `device`, its rows included (one copy per batch, not one per
    target layer: a copy from the host waits for the GPU)."""
    if device is None:
        return seq
    move = lambda xs: None if xs is None else [x.to(device) for x in xs]  # noqa: E731
    return replace(
        seq,
        source_keys=move(seq.source_keys), source_values=move(seq.source_values),
        target_keys=move(seq.target_keys), target_values=move(seq.target_values),
        key_weights=move(seq.key_weights), value_weights=move(seq.value_weights),
        src_rows=seq.src_rows.to(device), tgt_rows=seq.tgt_rows.to(device),
    )  # fmt: skip


def _summary(acc: LayerAccumulator, key_scale: str, weighted: bool) -> dict:
    out: dict = {}
    if key_scale == "variance":
        out["key_alpha"] = [round(float(a), 4) for a in acc.key_alpha]
        out["r2_key_ridge"] = round(acc.r2_key_ridge, 4)
    if weighted:
        out["alpha"] = {kind: [round(a, 4) for a in acc.alphas[kind]] for kind in "kv"}
    return out


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
    clock: PhaseClock | None = None,
) -> Bridge:
    """Fit a Bridge from `source_model` to `target_model` on calibration text.

    config: how (a `FitConfig`; None: `FitConfig()`, Full-Head Mapping on 32 x 256 tokens of prose).
        It is recorded in `bridge.calibration["recipe"]`; `layers_k` and `seq_len` are checked
        against the models before any forward.
    progress: progress bars on stderr, per phase (forwards with tokens/s, probe scores, solve,
        held-out scores).
    source_name, target_name: the models' names in the bridge and its recipe (default: the path
        or hub id they were loaded from); `bridgecache fit --recipe` loads the models by them.
    clock: a `PhaseClock` that collects each phase's seconds (benchmarks/fit_gpu.py reads it).

    The statistics live on the target's device; the source may be on another (its KV is moved
    once per sequence). If the held-out scoring fails, the fitted bridge is returned all the same,
    with a warning and `calibration["heldout_scores_error"]` saying why (the maps are finished).
    """
    c = _checked(config)
    if c.text_needed:
        raise ValueError(
            f"this FitConfig names its calibration text by digest only ({c.text_needed}, as a recipe "
            "records it): give the text itself, e.g. config.replace(text=[...]) or --text FILE"
        )
    source_spec = model_spec(source_model, source_tokenizer, name=source_name)
    target_spec = model_spec(target_model, target_tokenizer, name=target_name)
    c.check_against(source_spec)
    _check_window(c, source_spec, target_spec)
    tokenizers_match = same_tokenizer(source_tokenizer, target_tokenizer)
    if c.identity_if_same and tokenizers_match and _same_weights(source_model, target_model):
        bridge = Bridge.identity(target_spec, native_head=c.native_head)
        bridge.calibration = {"description": "exact identity: the same model on both sides; no regression"}
        return bridge

    device = target_model.get_input_embeddings().weight.device
    clock = clock or PhaseClock(device)
    user_text = isinstance(c.text, UserText)
    digest = Digest()
    with clock.phase("text"):  # reading and tokenizing the calibration text (CPU)
        seqs, policy = calibration_sequences(
            source_tokenizer, target_tokenizer, c.num_sequences, c.seq_len, c.domain, c.alignment_policy,
            c.native_head, c.heldout_every, c.seed, text=c.text if user_text else None, digest=digest,
        )  # fmt: skip
    _check_lengths(seqs, source_spec, target_spec)

    longest = max(int(s.source_ids.numel()) for s in seqs)
    batch = calibration_batch(c, source_spec, target_spec, longest, batch_kv_bytes(device))

    def sequences(with_weights: bool):
        return paired_kv(
            source_model, target_model, seqs, with_weights, c.boundaries, c.native_head, progress,
            "fit", batch,
        )  # fmt: skip

    probe_seqs = seqs if c.probe_subset is None else seqs[: c.probe_subset]
    if not any(s.heldout for s in probe_seqs):
        probe_seqs = probe_seqs + [next(s for s in seqs if s.heldout)]

    def probes(with_weights: bool):
        return paired_kv(
            source_model, target_model, probe_seqs, False, c.boundaries, c.native_head, progress,
            "probes", batch,
        )  # fmt: skip

    layers, info = fit_layer_maps(
        sequences,
        (source_spec.num_layers, source_spec.num_kv_heads, source_spec.head_dim),
        (target_spec.num_layers, target_spec.num_kv_heads, target_spec.head_dim),
        c,
        device=device,
        probe_sequences=probes,
        probe_dtype=_kv_dtype(source_model, target_model),
        clock=clock,
        progress=progress,
    )
    text_record = (
        {"text": "user", "text_sha256": digest.value, "text_documents": digest.documents}
        if user_text
        else {"text": "bridgecache.text", "domain": c.domain, "split": "calib"}
    )
    calibration = {
        **text_record,
        "num_sequences": c.num_sequences,
        "seq_len": c.seq_len,
        "seed": c.seed,
        "heldout_every": c.heldout_every,
        "boundaries": c.boundaries if info["weighting"] == "attention" else None,
        "probe_sequences": len(probe_seqs) if "layer_scores" in info else 0,
        "batch_sequences": batch,
        **info,
        # Exactly the config this call was given: `bridgecache fit --recipe` fits again from it.
        "recipe": c.recipe(source_spec.name, target_spec.name, digest.value if user_text else None),
    }
    if user_text:
        calibration["domain"] = "user"
    fingerprints = {"source": weight_fingerprint(source_model), "target": weight_fingerprint(target_model)}
    bridge = Bridge(
        source_spec, target_spec, c.method, policy, layers, c.native_head, calibration, fingerprints
    )
    if c.score_heldout:
        models = (source_model, target_model, source_tokenizer, target_tokenizer)
        _score(bridge, *models, seqs, c, clock, progress)
    return bridge


def _score(bridge, source, target, source_tokenizer, target_tokenizer, seqs, c, clock, progress) -> None:
    """Held-out scores into `bridge.calibration`; a failure leaves the fitted maps as they are."""
    from bridgecache.fitting.heldout import score_bridge, spread

    heldout = [s for s in seqs if s.heldout]
    tokens = sum(int(heldout[i].target_ids.numel()) for i in spread(len(heldout), c.score_sequences))
    try:
        with clock.phase("scoring", tokens):
            score_bridge(
                bridge, source, target, source_tokenizer, target_tokenizer, progress, sequences=seqs,
                limit=c.score_sequences,
            )  # fmt: skip
    except (RuntimeError, ValueError, MemoryError) as err:  # torch's errors (OOM, devices) included
        message = f"{type(err).__name__}: {err}"[:2000]
        bridge.calibration["heldout_scores_error"] = message
        warnings.warn(
            f"the bridge is fitted, but its held-out scoring failed ({message}); it has no "
            "heldout_scores (the quality gate falls back to R^2)",
            RuntimeWarning,
            stacklevel=3,
        )


def _check_window(c: FitConfig, *specs) -> None:
    """seq_len within both models' context windows (before any forward)."""
    for spec in specs:
        window = spec.max_position_embeddings
        if window and c.seq_len > window:
            raise FitOptionError(
                "seq_len", c.seq_len, f"at most {spec.name}'s context window of {window:,} tokens"
            )


def _check_lengths(seqs, *specs) -> None:
    """Across tokenizers the source reads its own tokens of the text: also within its window."""
    longest = max(int(s.source_ids.numel()) for s in seqs)
    for spec in specs:
        window = spec.max_position_embeddings
        if window and longest > window:
            raise ValueError(
                f"a calibration sequence is {longest:,} {spec.name} tokens, over its context window of "
                f"{window:,}: lower seq_len"
            )


def _kv_dtype(*models) -> torch.dtype:
    """The widest parameter dtype of the models: what their KV carries (probe rows keep it)."""
    dtypes = {next(m.parameters()).dtype for m in models}
    return torch.float32 if torch.float32 in dtypes or torch.float64 in dtypes else dtypes.pop()


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
