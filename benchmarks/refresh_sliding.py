"""Token refresh on a real sliding-window target: refreshing every translated token of a bridged
Gemma-3-270M cache gives the target's own greedy tokens.

    python benchmarks/refresh_sliding.py [--tokens 1024] [--new-tokens 16] [--noise 0.05] [--threads 1]

Gemma-3-270M has sliding-window layers (window 512) between full ones (5, 11, 17), so in a
1024-token context about half the refreshed tokens lie before the rows a sliding layer keeps.
The context is held-out prose (`text.token_sequences(..., split="eval")`) after Gemma's BOS.
The target reads it through two bridges from itself: the identity maps, and the identity maps with
Gaussian noise (std `--noise`) added to every key and value map (a poor bridge, also run without
refresh to show it is wrong); both are marked as fitted bridges ("fullhead"), since a handoff
never refreshes through the exact identity bridge. Each runs with
`HandoffConfig(refresh=RefreshConfig(1.0), route="handoff")` (every translated token recomputed through every
layer; the model is its own source) and is compared with the target's own `generate()`: greedy
tokens equal or not, and the largest difference of the new tokens' logits. Nothing is fitted;
float32 on the CPU.
"""

from __future__ import annotations

import argparse
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=1024, help="context tokens, BOS included")
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--noise", type=float, default=0.05)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()

    import torch

    from bridgecache import Bridge, BridgedCache, HandoffConfig, RefreshConfig, capture_kv, load_model
    from bridgecache.compat import cache_kwargs
    from bridgecache.text import token_sequences

    torch.set_num_threads(args.threads)
    model, tok = load_model("gemma3-270m")
    text = token_sequences(tok, 1, args.tokens - 1, domain="prose", split="eval")
    ids = torch.cat([torch.tensor([[tok.bos_token_id]]), text], dim=1)
    window = model.config.sliding_window
    print(f"gemma3-270m, {ids.shape[1]} context tokens, sliding window {window}, torch {torch.__version__}")

    def generate(cache=None):
        kwargs = dict(max_new_tokens=args.new_tokens, do_sample=False, output_logits=True)
        kwargs |= dict(return_dict_in_generate=True, pad_token_id=tok.pad_token_id)
        if cache is not None:
            kwargs |= cache_kwargs(model, cache)
        out = model.generate(ids, attention_mask=torch.ones_like(ids), **kwargs)
        return out.sequences[:, ids.shape[1] :], torch.stack(out.logits)

    start = time.perf_counter()
    native_tokens, native_logits = generate()
    print(f"native generate: {time.perf_counter() - start:.1f} s", flush=True)
    source = capture_kv(model, ids)
    identity = Bridge.identity(model, tok)
    noisy = Bridge.identity(model, tok)
    generator = torch.Generator().manual_seed(0)
    for layer in noisy.layers:
        for weight in (layer.key_weight, layer.value_weight):
            weight += args.noise * torch.randn(weight.shape, generator=generator)
    identity.method = noisy.method = "fullhead"  # the exact identity bridge is never refreshed
    poor = f"identity + noise {args.noise}"
    for name, bridge, refresh in ((poor, noisy, None), ("identity", identity, 1.0), (poor, noisy, 1.0)):
        start = time.perf_counter()
        config = HandoffConfig(refresh=None if refresh is None else RefreshConfig(refresh))
        cache = BridgedCache(bridge, source, model, ids, config=config, source_model=model)
        tokens, logits = generate(cache)
        seconds = time.perf_counter() - start
        same = bool(torch.equal(tokens, native_tokens))
        diff = float((logits - native_logits).abs().max())
        print(
            f"{name:>24}, refresh {refresh}: {cache.report().tokens_refreshed} tokens refreshed, "
            f"greedy tokens equal to native: {same}, max |logit diff| {diff:.2e} ({seconds:.1f} s)",
            flush=True,
        )
    print("native tokens:", tok.decode(native_tokens[0]))


if __name__ == "__main__":
    main()
