"""The `bridgecache` command: demo, fit, eval.

bridgecache demo                       a real handoff between two built-in models, on CPU
bridgecache fit --source A --target B  fit and save a bridge
bridgecache eval --bridge DIR ...      measure a bridge with the field's protocols + controls
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time

import torch

__all__ = ["main", "bridge_for"]

DEMO_CONTEXT = (
    "The lighthouse keeper of Port Ellis kept a logbook in which every ship was written down. "
    "On the night of the storm, the keeper wrote that three ships passed: the Marigold, carrying "
    "copper to the south, the Heron, a fishing boat with a red sail, and the Alder, which lost its "
    "mast near the rocks and was towed into the harbour at dawn by the Heron's crew. "
)
DEMO_PROMPT = "Question: Which ship lost its mast, and who towed it in?\nAnswer:"


def bridge_for(source_name: str, target_name: str, method: str, source=None, target=None, **fit_kwargs):
    """A cached bridge for two built-in/hub models, fitted (and cached) on first use.

    fit_kwargs (see `bridgecache.fitting.fit_bridge`) are part of the cache key: a bridge fitted
    with other settings is never returned for these.
    """
    from bridgecache.bridge import Bridge
    from bridgecache.fitting import fit_bridge
    from bridgecache.zoo import cache_root, load_model

    directory = cache_root() / "bridges" / _bridge_dir_name(source_name, target_name, method, fit_kwargs)
    if (directory / "bridge.json").exists():
        return Bridge.from_pretrained(directory)
    source, source_tok = (source, None) if source is not None else load_model(source_name)
    target, target_tok = (target, None) if target is not None else load_model(target_name)
    from bridgecache.zoo import load_tokenizer

    source_tok = source_tok or load_tokenizer(source_name)
    target_tok = target_tok or load_tokenizer(target_name)
    print(
        f"fitting a {method} bridge {source_name} -> {target_name} (once; cached in {directory})",
        file=sys.stderr,
    )
    bridge = fit_bridge(source, target, source_tok, target_tok, method=method, **fit_kwargs)
    bridge.save_pretrained(directory)
    return bridge


def _bridge_dir_name(source_name: str, target_name: str, method: str, fit_kwargs: dict) -> str:
    """`A-to-B-method`, plus a hash of the fit settings that change the bridge (none: the defaults)."""
    safe = lambda name: name.replace("/", "--")  # noqa: E731
    name = f"{safe(source_name)}-to-{safe(target_name)}-{method}"
    settings = {k: v for k, v in fit_kwargs.items() if k != "progress"}  # progress bars change nothing
    if settings:
        digest = hashlib.sha256(json.dumps(settings, sort_keys=True, default=str).encode()).hexdigest()
        name += f"-{digest[:12]}"
    return name


_WARM_UP_TEXT = "Warm-up: a short text that both paths read once before anything is timed."


def _warm_up(source, target, bridge, source_tok, target_tok) -> None:
    """Run each timed path once on a short unrelated text (first forwards allocate and initialise;
    the first token differs from the demo's, so no native prefix is memoised for it)."""
    from bridgecache.handoff import handoff, pad_token_id

    ids = target_tok(_WARM_UP_TEXT, return_tensors="pt")["input_ids"]
    target.generate(ids, max_new_tokens=2, do_sample=False, pad_token_id=pad_token_id(target_tok))
    handoff(
        source,
        target,
        bridge,
        _WARM_UP_TEXT,
        source_tokenizer=source_tok,
        target_tokenizer=target_tok,
        max_new_tokens=2,
        do_sample=False,
    )


def _demo(args) -> int:
    from bridgecache.capture import capture_kv
    from bridgecache.handoff import align_context, handoff, pad_token_id
    from bridgecache.zoo import load_model

    torch.manual_seed(0)
    source, source_tok = load_model(args.source)
    target, target_tok = load_model(args.target)
    if args.bridge:
        from bridgecache.bridge import Bridge

        bridge = Bridge.from_pretrained(args.bridge)
    else:
        bridge = bridge_for(args.source, args.target, args.method, source, target)
    context, prompt = args.context or DEMO_CONTEXT, args.prompt or DEMO_PROMPT
    gen = dict(max_new_tokens=args.max_new_tokens, do_sample=False)

    _warm_up(source, target, bridge, source_tok, target_tok)

    # Native: the target reads the whole context itself.
    ids = target_tok(context + prompt, return_tensors="pt")["input_ids"]
    pad = pad_token_id(target_tok)
    start = time.perf_counter()
    target.generate(ids, max_new_tokens=1, do_sample=False, pad_token_id=pad)
    native_ttft = time.perf_counter() - start
    start = time.perf_counter()
    native = target.generate(ids, **gen, pad_token_id=pad)
    native_s = time.perf_counter() - start
    native_text = target_tok.decode(native[0, ids.shape[1] :], skip_special_tokens=True)

    # Bridged: the source reads the context; the target continues from the translated cache.
    anchors = dict(native_tail=args.native_tail)
    first = handoff(source, target, bridge, context, prompt, source_tokenizer=source_tok,
                    target_tokenizer=target_tok, max_new_tokens=1, do_sample=False, **anchors)  # fmt: skip
    _, source_ids, _ = align_context(bridge, context, source_tok, target_tok)
    source_kv = capture_kv(source, source_ids)
    result = handoff(None, target, bridge, context, prompt, source_tokenizer=source_tok,
                     target_tokenizer=target_tok, source_cache=source_kv, **gen, **anchors)  # fmt: skip
    print(f"\nsource {args.source}  ->  target {args.target}   ({bridge.method} bridge)")
    bridged = len(result.cache.translated_positions)
    print(
        f"context + prompt: {len(ids[0])} target tokens; {bridged} bridged from the source, "
        f"{len(ids[0]) - bridged} computed by the target (native head and tail, last context token, prompt)\n"
    )
    print(f"native  : {native_text.strip()!r}")
    print(f"bridged : {result.text.strip()!r}\n")
    rows = [
        ("source prefill of the context", first.source_prefill_s),
        ("target native: time to first token", native_ttft),
        ("bridged: time to first token (translate + anchors + held-back)", first.generate_s),
        (f"target native: {args.max_new_tokens} new tokens", native_s),
        (f"bridged: {args.max_new_tokens} new tokens", result.generate_s),
    ]
    width = max(len(name) for name, _ in rows)
    for name, seconds in rows:
        print(f"  {name:<{width}}  {seconds:7.3f} s")
    print(
        f"  {'time-to-first-token ratio (native / bridged)':<{width}}  "
        f"{native_ttft / first.generate_s:7.2f} x"
    )
    print("\nA handoff pays off when the source has read the context anyway: its prefill is not repeated.")
    return 0


def _build_parser() -> argparse.ArgumentParser:
    from bridgecache.evaluation.cli import add_eval_command
    from bridgecache.fitting.cli import add_fit_command

    parser = argparse.ArgumentParser(
        prog="bridgecache",
        description="Hand one LLM's KV cache to another: fit bridges, run handoffs, measure them.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    demo = sub.add_parser("demo", help="a real handoff between two built-in models on CPU (offline)")
    demo.add_argument("--source", default="qwen2.5-coder-1.5b", help="model that reads the context")
    demo.add_argument("--target", default="qwen2.5-coder-0.5b", help="model that continues from it")
    demo.add_argument("--method", default="cachebridge", choices=["cachebridge", "fullhead"])
    demo.add_argument("--bridge", help="a saved bridge directory (default: fit one for the pair, once)")
    demo.add_argument("--context", help="context text (default: a short story)")
    demo.add_argument("--prompt", help="text the target reads after the context")
    demo.add_argument("--max-new-tokens", type=int, default=24)
    demo.add_argument(
        "--native-tail",
        type=int,
        default=0,
        help="last context tokens the target prefills itself (default 0)",
    )
    demo.set_defaults(func=_demo)

    add_fit_command(sub)
    add_eval_command(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
