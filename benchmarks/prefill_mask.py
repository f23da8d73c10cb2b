"""The target's prefill from a CUDA graph, with and without the causal mask transformers builds under capture.

    python benchmarks/prefill_mask.py --out DIR        # CUDA machine (~1 minute)

While a stream captures, transformers 5.17 never lets sdpa run causal without a mask
(`masking_utils._ignore_causal_mask_sdpa` returns False whenever `is_tracing()`, which counts stream
capture), so a captured prefill materialises a [1, 1, n, n] mask and sdpa leaves its flash and
cuDNN kernels. The native route's graphs and `gpu_handoff.py`'s "native, graph" row now give
decoders that take a prepared mask mapping none (`bridgecache.runtime.native_work.prefill.
mask_mapping`). Rows, per context length, median of --repeats after warm-up, CUDA-synchronised:
- eager: target(ids, use_cache=False, logits_to_keep=1), the target's own prefill;
- graph, transformers' mask: that forward replayed from a CUDA graph as transformers captures it;
- graph, no mask: the same with attention_mask={"full_attention": None} (what eager computes).
Each graph's last-token logits are checked against eager's (largest absolute difference within 5%
of the largest logit) before its time is reported. Random weights at the Qwen2.5 configs, bf16, sdpa.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from transformers import Qwen2ForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_handoff import config_of  # noqa: E402

from bridgecache.runtime.interop.graphs import capture  # noqa: E402
from bridgecache.runtime.native_work.prefill import no_mask  # noqa: E402

LOGIT_TOLERANCE = 0.05  # of the largest eager logit: bf16 logits of one forward at other kernels' sums


def timed(fn, repeats: int) -> float:
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def rows_for(model, n: int, repeats: int) -> dict:
    ids = torch.randint(3, model.config.vocab_size, (1, n), device="cuda")

    def forward(masks=None):
        return model(input_ids=ids, use_cache=False, logits_to_keep=1, attention_mask=masks).logits

    row = {"tokens": n}
    with torch.no_grad():
        eager = forward().float()
        row["eager_ms"] = timed(forward, repeats)
        for name, masks in (("graph_mask", None), ("graph_no_mask", no_mask())):
            graph, logits = capture(lambda masks=masks: forward(masks))
            graph.replay()
            torch.cuda.synchronize()
            diff = float((logits.float() - eager).abs().max())
            bound = LOGIT_TOLERANCE * float(eager.abs().max())
            if not diff <= bound:  # NaN fails too
                raise AssertionError(f"{name} at {n}: logits {diff:.3g} from eager's (bound {bound:.3g})")
            row[f"{name}_ms"] = timed(graph.replay, repeats)
            row[f"{name}_max_diff"] = diff
            del graph, logits
            torch.cuda.empty_cache()
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target", default="0.5b", choices=["0.5b", "1.5b", "7b"])
    ap.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096, 8192, 16384, 32768])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("needs CUDA (graph capture)")
    torch.manual_seed(1)
    config = config_of(args.target, smoke=False)
    config._attn_implementation = "sdpa"
    model = Qwen2ForCausalLM(config).to("cuda", torch.bfloat16).eval()
    info = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "target": args.target,
            "date": time.strftime("%Y-%m-%d %H:%M:%S %Z")}  # fmt: skip
    import transformers

    info["transformers"] = transformers.__version__
    print(json.dumps(info), flush=True)
    rows = []
    for n in args.lengths:
        try:
            row = rows_for(model, n, args.repeats)
        except Exception as e:  # keep the other rows
            row = {"tokens": n, "error": f"{type(e).__name__}: {e}"[:300]}
        print(json.dumps(row), flush=True)
        rows.append(row)
    lines = [
        f"{info['device']}; torch {info['torch']}, transformers {info['transformers']}; "
        f"Qwen2.5-{args.target} shapes, bf16, sdpa; {info['date']}",
        "",
        "| tokens | eager ms | graph, transformers' mask ms | graph, no mask ms | no mask / eager "
        "| max logit diff |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['tokens']} | error: {r['error']} |||||")
            continue
        lines.append(
            f"| {r['tokens']} | {r['eager_ms']:.2f} | {r['graph_mask_ms']:.2f} | {r['graph_no_mask_ms']:.2f} "
            f"| {r['graph_no_mask_ms'] / r['eager_ms']:.2f} | {r['graph_no_mask_max_diff']:.3g} |"
        )
    print("\n".join(lines))
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "prefill-mask.json").write_text(json.dumps({"info": info, "rows": rows}, indent=1))
        (args.out / "prefill-mask.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
