"""What a bridge is, at a glance: `repr`, notebook markdown, the `inspect` report and its plot.

    repr(bridge)          one line: pair, method, layers, size, mean held-out R^2
    bridge (notebook)     the same as a markdown table per target layer
    inspect_report(...)   what `bridgecache inspect` prints
    plot_bridge(...)      PNG: per-layer held-out R^2; which source layers feed each target layer

Names and text from a bridge file are escaped (bridgecache.untrusted): they reach terminals and
notebooks. Knows a Bridge's fields (and matplotlib, imported only to plot).
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

from bridgecache.untrusted import printable

__all__ = ["short_summary", "markdown_summary", "inspect_report", "plot_bridge", "feed_matrix"]


def short_summary(bridge) -> str:
    """One line, for `repr(bridge)`."""
    k, v = _mean(bridge, "r2_key"), _mean(bridge, "r2_value")
    return (
        f"Bridge({printable(bridge.source.name, 200)} -> {printable(bridge.target.name, 200)}, "
        f"method={bridge.method}, "
        f"{len(bridge.layers)} target layers, {bridge.num_parameters():,} parameters "
        f"({_mb(bridge.nbytes())} in memory), held-out R2 keys {_fmt(k)} values {_fmt(v)})"
    )


def markdown_summary(bridge) -> str:
    """A markdown header line and per-layer table (the notebook view)."""
    lines = [
        f"**Bridge** `{printable(bridge.source.name, 200)}` -> `{printable(bridge.target.name, 200)}`: "
        f"method `{bridge.method}`, "
        f"alignment `{bridge.alignment_policy}`, native head {bridge.native_head}, "
        f"{bridge.num_parameters():,} parameters ({_mb(bridge.nbytes())} in memory)",
        "",
        "| target layer | source layers | inputs per head | held-out R2 keys | held-out R2 values |",
        "|---:|---|---:|---:|---:|",
    ]
    for i, layer in enumerate(bridge.layers):
        sources = ", ".join(str(s) for s in layer.source_layers)
        lines.append(
            f"| {i} | {sources} | {layer.inputs.shape[1]} | {_fmt(layer.r2_key)} | {_fmt(layer.r2_value)} |"
        )
    k, v = _mean(bridge, "r2_key"), _mean(bridge, "r2_value")
    lines.append(f"| mean | | | {_fmt(k)} | {_fmt(v)} |")
    return "\n".join(lines)


def inspect_report(bridge, location: str | None = None, directory: Path | None = None) -> str:
    """The `bridgecache inspect` text: what it maps, how it was made, its size, per-layer scores."""
    from bridgecache.bridge.recipe import recipe_command, recipe_of

    calib = bridge.calibration
    lines = [f"bridge {location}" if location else "bridge", f"  {short_summary(bridge)}", ""]
    for role, spec in (("source", bridge.source), ("target", bridge.target)):
        lines.append(
            f"  {role:<7} {spec.name}  ({spec.model_type}, {spec.num_layers} layers, "
            f"{spec.num_kv_heads} KV heads x {spec.head_dim}, tokenizer {spec.tokenizer or 'unknown'})"
        )
    lines.append(
        f"  method  {bridge.method}; alignment {bridge.alignment_policy}; the target computes "
        f"positions [0, {bridge.native_head}) itself"
    )
    if "num_sequences" in calib:
        rows = calib.get("rows", {})
        lines.append(
            f"  calibration  {calib['num_sequences']} x {calib['seq_len']} tokens of {calib.get('domain')} "
            f"(seed {calib.get('seed')}); {rows.get('train', '?')} training rows, "
            f"{rows.get('heldout', '?')} held-out rows"
        )
    elif "description" in calib:
        lines.append(f"  calibration  {calib['description']}")
    size = f"  size    {bridge.num_parameters():,} parameters, {_mb(bridge.nbytes())} as float32 in memory"
    if directory is not None:
        on_disk = sum(p.stat().st_size for p in Path(directory).iterdir() if p.is_file())
        size += f", {_mb(on_disk)} on disk ({calib.get('stored_dtype', 'float32')} tensors)"
    lines.append(size)
    if calib.get("recipe"):
        lines.append(f"  made by {recipe_command(recipe_of(bridge))}")
    for role, entry in calib.get("fingerprints", {}).items():
        lines.append(
            f"  fitted on {role} {entry['zoo']}: file {entry['gguf']}, tokenizer {entry['tokenizer']}"
        )
    lines += ["", bridge.summary()]
    return "\n".join(lines)


def feed_matrix(bridge) -> torch.Tensor:
    """[target layers, source layers] float: the fraction of each target layer's input slots from each
    source layer (rows sum to 1)."""
    out = torch.zeros(bridge.target.num_layers, bridge.source.num_layers)
    for t, layer in enumerate(bridge.layers):
        src = layer.inputs[..., 0].flatten().cpu()
        out[t] = torch.bincount(src, minlength=bridge.source.num_layers).float() / max(src.numel(), 1)
    return out


def plot_bridge(bridge, path: str | Path) -> Path:
    """Save a PNG: held-out R^2 of keys and values per target layer, and the source-layer feeds."""
    from matplotlib.figure import Figure  # no pyplot: no backend or global figure state touched
    from matplotlib.ticker import MaxNLocator

    layers = list(range(len(bridge.layers)))
    fig = Figure(figsize=(11, 4))
    quality, feeds = fig.subplots(1, 2)
    for attr, label in (("r2_key", "keys"), ("r2_value", "values")):
        quality.plot(layers, [getattr(layer, attr) for layer in bridge.layers], marker="o", label=label)
    quality.set(xlabel="target layer", ylabel="held-out R$^2$", title="map quality per layer")
    quality.legend()
    quality.grid(alpha=0.3)
    image = feeds.imshow(feed_matrix(bridge).T.numpy(), aspect="auto", origin="lower", cmap="Blues")
    feeds.set(
        xlabel="target layer", ylabel="source layer", title="which source layers feed each target layer"
    )
    fig.colorbar(image, ax=feeds, label="share of input slots")
    for axis in (quality.xaxis, feeds.xaxis, feeds.yaxis):
        axis.set_major_locator(MaxNLocator(integer=True))  # layers are whole numbers
    fig.suptitle(
        f"{printable(bridge.source.name, 80)} -> {printable(bridge.target.name, 80)} ({bridge.method})"
    )
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=100)
    return path


def _mean(bridge, attr: str) -> float:
    known = [getattr(layer, attr) for layer in bridge.layers if not math.isnan(getattr(layer, attr))]
    return sum(known) / len(known) if known else math.nan


def _fmt(x: float) -> str:
    return "-" if math.isnan(x) else f"{x:.3f}"


def _mb(n: int) -> str:
    return f"{n / 1e6:.2f} MB"
