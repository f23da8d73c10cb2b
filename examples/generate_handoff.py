"""Hand a context from one model to another: the source reads it, the target continues from its cache.

    python examples/generate_handoff.py                                   # Qwen2.5-Coder 1.5B -> 0.5B
    python examples/generate_handoff.py --source smollm2-135m --target gemma3-270m
    python examples/generate_handoff.py --source ... --target ... --bridge bridges/my-bridge

Models are built-in names (offline), hub ids or local directories. Without --bridge, a bridge is
fitted first; fit once with `bridgecache fit --source A --target B --out DIR` and pass --bridge DIR.
"""

from __future__ import annotations

import argparse
import time

import torch

from bridgecache import (
    Bridge,
    BridgedCache,
    FitConfig,
    HandoffConfig,
    capture_kv,
    fit_bridge,
    load_model,
    tokenize_context,
)

CONTEXT = (
    "The lighthouse keeper of Port Ellis kept a logbook in which every ship was written down. "
    "On the night of the storm, three ships passed: the Marigold, carrying copper to the south, "
    "the Heron, a fishing boat with a red sail, and the Alder, which lost its mast near the rocks "
    "and was towed into the harbour at dawn by the Heron's crew."
)
PROMPT = "\nQuestion: Which ship lost its mast, and who towed it in?\nAnswer:"


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description="Generate from a context that another model read.")
    parser.add_argument("--source", default="qwen2.5-coder-1.5b", help="the model that reads the context")
    parser.add_argument("--target", default="qwen2.5-coder-0.5b", help="the model that continues")
    parser.add_argument("--bridge", help="load this saved bridge directory instead of fitting one")
    parser.add_argument("--calib-seqs", type=int, default=32, help="calibration sequences (fitting)")
    parser.add_argument("--seq-len", type=int, default=256, help="tokens per calibration sequence (fitting)")
    parser.add_argument("--context", default=CONTEXT)
    parser.add_argument("--prompt", default=PROMPT)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    args = parser.parse_args(argv)

    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    source, source_tok = load_model(args.source, dtype=dtype, device=device)
    target, target_tok = load_model(args.target, dtype=dtype, device=device)
    if args.bridge:
        bridge = Bridge.from_pretrained(args.bridge)
        bridge.check(source, target)  # raises, naming each field, if it was fitted for other models
    else:
        config = FitConfig(num_sequences=args.calib_seqs, seq_len=args.seq_len)
        bridge = fit_bridge(
            source, target, source_tok, target_tok, config, source_name=args.source, target_name=args.target
        )

    # 1. The source reads the context. Across tokenizers, the alignment says which source token
    #    feeds each target token (None when both models share a tokenizer); the words let the
    #    refresh take whole words and numbers, as handoff() does.
    alignment, source_ids, context_ids, words = tokenize_context(
        bridge, args.context, source_tok, target_tok, words=True
    )
    start = time.perf_counter()
    source_kv = capture_kv(source, source_ids)
    prefill_s = time.perf_counter() - start

    # 2. The target's cache of the same context, translated from the source's. The source reads
    #    the prompt (in its own tokens) over its cache to choose the 20% of the context that the
    #    target recomputes itself, in whole words (HandoffConfig's default). Nothing is translated
    #    yet: layer i is translated when the target's layer i first reads it, and the recomputed
    #    tokens join the target's first forward. route="handoff": this script shows the translated
    #    cache; the default "auto" lets the cost gate answer a context this short with the
    #    target's own prefill where that reaches the first token sooner (cache.report() says).
    source_prompt = source_tok(args.prompt, add_special_tokens=False, return_tensors="pt").input_ids
    cache = BridgedCache(
        bridge,
        source_kv,
        target,
        context_ids,
        alignment=alignment,
        source_model=source,
        prompt_ids=source_prompt,
        words=words,
        config=HandoffConfig(route="handoff"),
    )
    cached = cache.get_seq_length()  # context positions in the cache (all but the last token)

    # 3. The target continues. Pass the context and the prompt: the cache holds the context except
    #    its last token, which generate() feeds together with the prompt.
    prompt_ids = target_tok(args.prompt, add_special_tokens=False, return_tensors="pt").input_ids
    input_ids = torch.cat([context_ids, prompt_ids], dim=1).to(target.device)
    pad_id = target_tok.eos_token_id if target_tok.pad_token_id is None else target_tok.pad_token_id
    start = time.perf_counter()
    output = target.generate(
        input_ids,
        attention_mask=torch.ones_like(input_ids),
        past_key_values=cache,  # `cache=cache` on transformers >= 5.24
        max_new_tokens=args.max_new_tokens,
        do_sample=False,
        pad_token_id=pad_id,  # a pad id of 0 is a real id
    )
    generate_s = time.perf_counter() - start
    new_ids = output[0, input_ids.shape[1] :]
    text = target_tok.decode(new_ids, skip_special_tokens=True)

    print(f"{args.source} read {source_ids.shape[1]} tokens in {prefill_s:.2f} s")
    print(
        f"{args.target} continued from a bridged cache of {cached} positions "
        f"({len(cache.materialized_layers)}/{len(cache.layers)} layers translated): "
        f"{len(new_ids)} new tokens in {generate_s:.2f} s"
    )
    print(f"answer: {text.strip()!r}")
    print(cache.report())  # what the target computed itself, and its share of a prefill in FLOPs
    return {
        "text": text,
        "new_tokens": len(new_ids),
        "context_tokens": context_ids.shape[1],
        "cached_positions": cached,
        "translated_layers": len(cache.materialized_layers),
        "target_layers": len(cache.layers),
    }


if __name__ == "__main__":
    main()
