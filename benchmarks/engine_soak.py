"""An engine under load: memory over many handoffs of many lengths, and close() giving it back.

    python benchmarks/engine_soak.py --out DIR              # CUDA: Qwen2.5-1.5B -> 7B shapes, bf16
    python benchmarks/engine_soak.py --smoke                # tiny shapes on the CPU, to check the script
    python benchmarks/engine_soak.py --cpu --handoffs 300   # CPU: RSS over 300 handoffs of 30 lengths

Random-weight models at the published configs (benchmarks/gpu_handoff.py's shapes and random
Full-Head-shaped bridge), one `HandoffEngine`; every cache `HandoffConfig(route="handoff")` (the
soak exercises the handoff, never the cost gate's other route). Each handoff: the source's KV of
a random context (captured once per length, not timed), a 16-token question, the engine's cache
and its generate() to the first token, whose logits are checked before the handoff counts.
A length's first request runs eagerly at its exact shape; its second captures CUDA graphs at
bucketed shapes (masked padding) and later ones replay them, unless the engine's graph budget
evicted them (40 lengths cycle through it: a length then runs eagerly, then captures again).
bf16 sums differ between the two in the last bits, and on random weights the source's near-tied
attention scores can then refresh another set of tokens, which moves the logits as far as another
context would (gpu_handoff.TOLERANCE says by how much). So each handoff is checked with
gpu_handoff's `check`: its logits within TOLERANCE (relative L2) of an earlier handoff at its
length that refreshed the same tokens; where none did, its refresh sharing MIN_SHARED of the
first's (a stale buffer, or another context's KV or reading, fails one or the other). Reported
beside: how many refreshed sets a length saw, the share of first tokens equal to the first
handoff's, and a control: a different context under the same question at the smallest length,
how far its logits and refresh lie from the first (the margin the check has).
`--seconds` bounds the run's wall time from the process start: it stops at the end of the first
round after which another round as long would pass it, and reports the handoffs that ran.
Reported:
- the engine's own device memory (`HandoffEngine.device_bytes`: plans, captured graphs) and the
  allocator's peak beyond the models, the contexts' KV and one cache, against the bound;
- after `close()`: allocated memory against what it was before the engine existed (within 1%);
- CPU: RSS after each round of lengths (the last within 5% of the first).
Prints device, date, torch/transformers versions; --out writes engine-soak.json there.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import sys
import time
from pathlib import Path

import torch
import transformers
from transformers import AutoModelForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_handoff import (  # noqa: E402
    FIRST_ID,
    MIN_SHARED,
    QUESTION,
    TOLERANCE,
    FirstToken,
    check,
    config_of,
    distance,
    random_fullhead_bridge,
    shared,
    summary,
)

from bridgecache import BridgedCache, HandoffConfig, HandoffEngine, capture_kv  # noqa: E402
from bridgecache.runtime.engine import generate  # noqa: E402

BOUND = 2 << 30  # the documented bound: the engine's own memory beyond the models and one cache
HANDOFF = HandoffConfig(route="handoff")


def lengths(count: int, smallest: int, largest: int) -> list[int]:
    """`count` lengths spread log-evenly over [smallest, largest], none a multiple of 256 (every
    one a bucket of its own or sharing one, as real documents do)."""
    ratio = (largest / smallest) ** (1 / max(1, count - 1))
    return sorted({int(smallest * ratio**i) + 7 for i in range(count)})


def process_seconds() -> float:
    """Wall seconds since this process started (its imports and models count against --seconds)."""
    with open("/proc/self/stat") as f:  # starttime: field 22, in clock ticks after boot
        ticks = int(f.read().rsplit(")", 1)[1].split()[19])
    with open("/proc/uptime") as f:
        return float(f.read().split()[0]) - ticks / os.sysconf("SC_CLK_TCK")


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@torch.no_grad()
def soak(source, target, bridge, sizes: list[int], handoffs: int, device, deadline: float) -> dict:
    """`handoffs` handoffs cycling through `sizes` on one engine (see the module docstring), until
    `deadline` (a `time.perf_counter()` value) would pass during another round."""
    cuda = device.type == "cuda"
    vocab = target.config.vocab_size
    gen = dict(max_new_tokens=1, do_sample=False, pad_token_id=0)
    gen |= dict(output_logits=True, return_dict_in_generate=True)  # the first token's, checked
    inputs = {}
    for n in sizes:  # the contexts the source has read (never timed, held throughout)
        context = torch.randint(FIRST_ID, vocab, (1, n), device=device)
        question = torch.randint(FIRST_ID, vocab, (1, QUESTION), device=device)
        inputs[n] = (context, question, torch.cat([context, question], 1), capture_kv(source, context))
    if cuda:
        torch.cuda.synchronize()
        before_engine = torch.cuda.memory_allocated()
    engine = HandoffEngine(bridge, source, target)

    def handoff(context, question, full, kv) -> FirstToken:
        cache = BridgedCache(
            bridge,
            kv,
            target,
            context,
            config=HANDOFF,
            source_model=source,
            prompt_ids=question,
            engine=engine,
        )
        return FirstToken(generate(target, cache, full, **gen).logits[0], cache)

    earlier, seen, same_token = {}, [], []  # earlier[n]: the refreshed sets seen at n, the first first
    peaks, engine_bytes, marks, seconds = [], [], [], []
    largest_cache, stopped, round_start = 0, False, time.perf_counter()
    for i in range(handoffs):
        n = sizes[i % len(sizes)]
        if cuda:
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
        start = time.perf_counter()
        out = handoff(*inputs[n])
        if cuda:
            torch.cuda.synchronize()  # the first token is there
        seconds.append(time.perf_counter() - start)
        result = out.settled()  # on the CPU, with the refreshed columns: not timed
        first = earlier.get(n, [None])[0]
        seen.append(check(result, earlier.setdefault(n, []), f"handoff {i} at {n} tokens"))
        if first is not None:
            same_token.append(int(result.logits.argmax()) == int(first.logits.argmax()))
        if cuda:
            cache_bytes = sum(
                t.numel() * t.element_size() for layer in out.cache.layers for t in (layer.keys, layer.values)
            )
            largest_cache = max(largest_cache, cache_bytes)
            peaks.append(torch.cuda.max_memory_allocated() - base - cache_bytes)
            engine_bytes.append(engine.device_bytes)
        del out
        if (i + 1) % len(sizes) == 0:
            gc.collect()
            marks.append(rss())
            gib = 2**30
            extra = (
                f", engine {engine.device_bytes / gib:.2f} GiB, beyond a cache {max(peaks) / gib:.2f}"
                if cuda
                else ""
            )
            checked = summary(seen)
            took = f"{i + 1} handoffs, {sum(seconds):.0f} s"
            logits = f"logits within {checked['max_distance'] or 0:.3f} of the same refresh"
            sets = f"{checked['other_refreshes']} other refreshes"
            print(f"  round {len(marks)}: {took}, RSS {marks[-1] / 2**20:.0f} MiB{extra}; {logits}, {sets}",
                  flush=True)  # fmt: skip
            now = time.perf_counter()
            if i + 1 < handoffs and now + (now - round_start) > deadline:
                print(f"  stopping after {i + 1} handoffs: another round would pass --seconds", flush=True)
                stopped = True
                break
            round_start = now
    # the check's margin: the logits and refresh of another context under the same question
    n = sizes[0]
    question = inputs[n][1]
    other = torch.randint(FIRST_ID, vocab, (1, n), device=device)
    full = torch.cat([other, question], 1)
    control = handoff(other, question, full, capture_kv(source, other)).settled()
    reference = earlier[n][0]
    margin = {"tokens": n, "distance": distance(control, reference), "shared": shared(control, reference)}
    del other, full
    checked = summary(seen)
    report = {
        "handoffs": len(seconds),
        "handoffs_asked": handoffs,
        "stopped_by_seconds": stopped,
        "seconds_since_process_start": process_seconds(),
        "tolerance": TOLERANCE,
        "min_shared": MIN_SHARED,
        "checked_handoffs": checked["compared"],
        "max_logit_distance_checked": checked["max_distance"],
        "handoffs_with_another_refresh": checked["other_refreshes"],
        "min_refresh_shared": checked["min_shared"],
        "refreshed_sets_per_length_max": max(len(v) for v in earlier.values()),
        "other_refresh_distance_max": max(
            (s["distance_other_refresh"] for s in seen if "shared" in s), default=None
        ),
        "first_token_as_the_first_share": sum(same_token) / max(1, len(same_token)),
        "control_another_context": margin,
        "lengths": sizes,
        "median_s": sorted(seconds)[len(seconds) // 2],
        "rss_per_round_mib": [m / 2**20 for m in marks],
    }
    if cuda:
        torch.cuda.synchronize()
        held = engine.device_bytes
        engine.close()
        del engine
        gc.collect()
        torch.cuda.synchronize()
        after = torch.cuda.memory_allocated()
        torch._C._cuda_clearCublasWorkspaces()  # a diagnosis: what of `after` is cuBLAS workspaces
        report["allocated_after_close_and_cublas_clear_gib"] = torch.cuda.memory_allocated() / 2**30
        report |= {
            "engine_bytes_max_gib": max(engine_bytes) / 2**30,
            "engine_bytes_at_end_gib": held / 2**30,
            "transient_peak_beyond_one_cache_gib": max(peaks) / 2**30,
            "largest_cache_gib": largest_cache / 2**30,
            "allocated_before_engine_gib": before_engine / 2**30,
            "allocated_after_close_gib": after / 2**30,
            "after_close_vs_before": after / before_engine - 1,
            "bound_gib": BOUND / 2**30,
        }
    return report


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU")
    parser.add_argument(
        "--cpu", action="store_true", help="run on the CPU (tiny shapes unless --real-shapes)"
    )
    parser.add_argument("--handoffs", type=int, default=None)
    parser.add_argument("--lengths", type=int, default=None, help="distinct context lengths")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument(
        "--seconds",
        type=float,
        default=300.0,
        help="wall-time budget from the process start: stop at the end of the first round after which "
        "another round as long would pass it",
    )
    args = parser.parse_args()
    cuda = torch.cuda.is_available() and not (args.smoke or args.cpu)
    device = torch.device("cuda" if cuda else "cpu")
    small = not cuda
    count = args.lengths or (40 if cuda else 30)
    handoffs = args.handoffs or (1000 if cuda else (60 if args.smoke else 300))
    sizes = lengths(count, 512, 32768) if cuda else lengths(count, 16, 400)
    dtype = torch.bfloat16 if cuda else torch.float32
    torch.manual_seed(0)
    models = []
    for name in ("1.5b", "7b"):
        config = config_of(name, smoke=small)
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
        models.append(model.eval())
    source, target = models
    bridge = random_fullhead_bridge(source.config, target.config)
    print(f"device: {torch.cuda.get_device_name() if cuda else 'cpu'}; date {datetime.date.today()}; "
          f"torch {torch.__version__}, transformers {transformers.__version__}")  # fmt: skip
    print(f"{handoffs} handoffs over {len(sizes)} lengths {sizes[0]}..{sizes[-1]}, 1.5B -> 7B shapes")
    deadline = time.perf_counter() + args.seconds - process_seconds()
    report = soak(source, target, bridge, sizes, handoffs, device, deadline)
    report |= {"device": torch.cuda.get_device_name() if cuda else "cpu", "date": str(datetime.date.today())}
    for key, value in report.items():
        if key != "lengths":
            print(f"  {key}: {value}")
    if args.out:  # before the verdicts: a failed one keeps what was measured
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "engine-soak.json").write_text(json.dumps(report, indent=1))
    if cuda:
        assert report["engine_bytes_max_gib"] * 2**30 <= BOUND, "the engine held more than its bound"
        assert abs(report["after_close_vs_before"]) <= 0.01, "close() did not give the memory back"
    margin = report["control_another_context"]
    if margin["distance"] <= TOLERANCE and margin["shared"] >= MIN_SHARED:  # printed: not the engine's fault
        print(f"  WARNING: another context at {margin['tokens']} tokens passes the check: it cannot see one")
    marks = report["rss_per_round_mib"]
    if len(marks) >= 2:
        print(f"  RSS last round / first round: {marks[-1] / marks[0]:.3f}")


if __name__ == "__main__":
    main()
