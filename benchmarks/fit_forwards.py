"""What a fit's forwards phase costs beyond the two models' own forwards, and the FLOP bound.

    python benchmarks/fit_forwards.py --pair Qwen3-14B [--depth 0.5] [--batch 2 8] [--batches 8]
    python benchmarks/fit_forwards.py --pair Qwen2.5 --smoke --batches 2     # tiny configs on CPU

Both models of a pair of `benchmarks/fit_gpu.py` (random weights at the published configs, bf16,
sdpa, on one device) run over the same random 1,024-token sequences, `--batch` sequences per
forward, each row timed over `--batches` forwards after one warm-up:
- "decoders": each model's decoder (no logits, no cache) over the ids: what a fit cannot avoid;
- "capture": `capture_kv` of both (the KV kept in a DynamicCache);
- "paired": `fitting.runner.paired_kv`'s batch, as the fit's forwards phase runs it (KV captured,
  keys un-rotated, values in float32), without and with CacheBridge's attention weights.
Each row's result is checked before its time is printed (the captured target values equal the
decoders' own; the paired rows finite and of the expected count). FLOPs per token count every
linear layer of the decoders (2 x weights) and causal attention (2 x 2 x q-heads x head_dim x
tokens / 2 per layer); "TFLOP/s" is that over the row's time, beside the device's dense bf16 peak
given by --peak-tflops (989 for an H100/H200 SXM).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
from transformers import DynamicCache

sys.path.insert(0, str(Path(__file__).resolve().parent))
from fit_gpu import PAIRS, build  # noqa: E402

from bridgecache.compat import cache_kwargs  # noqa: E402
from bridgecache.fitting.calibration import CalibSequence  # noqa: E402
from bridgecache.fitting.runner import paired_kv  # noqa: E402
from bridgecache.kv.capture import capture_kv  # noqa: E402


def flops_per_token(model, tokens: int) -> float:
    """Forward FLOPs per token of `model`'s decoder over sequences of `tokens` (causal)."""
    decoder = model.get_decoder()
    linear = sum(m.weight.numel() for m in decoder.modules() if isinstance(m, torch.nn.Linear))
    c = model.config
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    attention = 2 * 2 * c.num_attention_heads * head_dim * (tokens / 2) * c.num_hidden_layers
    return 2 * linear + attention


def sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, batches: int, device) -> tuple[float, object]:
    """(median seconds of one call over `batches` calls after a warm-up, the last result)."""
    result = fn()
    times = []
    for _ in range(batches):
        sync(device)
        start = time.perf_counter()
        result = fn()
        sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times), result


def measure(source, target, batch: int, seq_len: int, batches: int, device, vocab: int) -> list:
    """[(row, seconds per batch)] for one batch size, each row's result checked first."""
    ids = torch.randint(3, vocab, (batch, seq_len), generator=torch.Generator().manual_seed(batch))
    rows = torch.arange(1, seq_len)
    seqs = [CalibSequence(ids[b], ids[b], rows, rows, heldout=False) for b in range(batch)]
    on_device = ids.to(device)

    def decoders():
        cache, decoder = DynamicCache(), target.get_decoder()
        with torch.no_grad():
            hidden = source.get_decoder()(input_ids=on_device, use_cache=False).last_hidden_state
            decoder(input_ids=on_device, use_cache=True, **cache_kwargs(decoder, cache))
        return hidden, cache

    def paired(weights: bool):
        return lambda: next(iter(paired_kv(source, target, seqs, weights, progress=False, batch=batch)))

    base, (hidden, native) = timed(decoders, batches, device)
    runs = [("decoders", base, None)]
    for name, fn in (
        ("capture", lambda: (capture_kv(source, ids), capture_kv(target, ids))),
        ("paired", paired(False)),
        ("paired + weights", paired(True)),
    ):
        runs.append((name, *timed(fn, batches, device)))
    assert torch.isfinite(hidden.float()).all()
    want = native.layers[0].values
    assert torch.equal(runs[1][2][1].values[0], want), "capture_kv's target values differ from the decoder's"
    for name, _, result in runs[2:]:
        assert result.target_values[0].shape[2] == seq_len, f"{name}: {result.target_values[0].shape}"
        assert torch.isfinite(result.source_keys[-1]).all(), f"{name}: non-finite keys"
        assert torch.equal(result.target_values[0], want.float()), f"{name}: values differ"
        assert (result.key_weights is not None) == (name == "paired + weights")
    return [(name, seconds) for name, seconds, _ in runs]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pair", default="Qwen3-14B", help="a pair of fit_gpu.PAIRS whose names contain it")
    ap.add_argument("--depth", type=float, default=1.0)
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--batch", type=int, nargs="+", default=[2, 8], help="sequences per forward")
    ap.add_argument("--batches", type=int, default=8, help="timed forwards per row")
    ap.add_argument("--peak-tflops", type=float, default=989.0)
    ap.add_argument("--smoke", action="store_true", help="tiny configs on CPU, float32")
    args = ap.parse_args()
    device = "cpu" if args.smoke else "cuda:0"
    dtype = torch.float32 if args.smoke else torch.bfloat16
    pair = next(p for p in PAIRS if any(args.pair in name for name in p))
    source, target = (build(n, device, dtype, args.smoke, args.depth) for n in pair)
    seq_len = 64 if args.smoke else args.seq_len
    per_token = [flops_per_token(m, seq_len) for m in (source, target)]
    where = torch.cuda.get_device_name() if device != "cpu" else "cpu"
    print(f"# {pair[0]} -> {pair[1]} (depth {args.depth}), {where}, torch {torch.__version__}")
    print(f"# GFLOP per token: {pair[0]} {per_token[0] / 1e9:.2f}, {pair[1]} {per_token[1] / 1e9:.2f}")
    print("| batch x tokens | row | ms per batch | tokens/s | TFLOP/s | of peak | over decoders |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for batch in args.batch:
        runs = measure(source, target, batch, seq_len, args.batches, device, 500 if args.smoke else 150_000)
        flops = batch * seq_len * sum(per_token)
        for name, seconds in runs:
            tflops = flops / seconds / 1e12
            print(
                f"| {batch} x {seq_len} | {name} | {seconds * 1e3:.1f} | {batch * seq_len / seconds:,.0f} | "
                f"{tflops:.0f} | {tflops / args.peak_tflops:.0%} | {seconds / runs[0][1]:.2f}x |"
            )
        if device != "cpu":
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
