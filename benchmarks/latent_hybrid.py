"""Latent caches (MLA) and hybrids: what their caches hold, what a closed-form map into or out of
a latent fits, and whether translating a hybrid's attention layers could save time.

    python benchmarks/latent_hybrid.py [--out docs/latent-and-hybrid.md] [--threads 1]

MLA (DeepSeek V3, tiny random config of tests/tiny_models.py): transformers' DynamicCache holds,
per layer, one "head" whose keys are the normed latent c [tokens, kv_lora_rank] (position-free)
and whose values are the shared rotary key k_rot [tokens, qk_rope_head_dim] (rotated, in
interleaved pairs); printed from a forward. The closed-form map: per target layer, ridge
regression (lambda = 1e-3 x mean diagonal) from the position-free parts of the source layer at the
same depth (a Qwen2 / Llama: un-rotated keys and values of every head; DeepSeek: c and un-rotated
k_rot) to the target's position-free parts, fitted on 8 random-id sequences of 48 tokens, scored
on 8 more: held-out R^2 per target part (mean over layers), and the target's next-token agreement
when it reads 8 tokens after a 40-token context from a cache built of the mapped parts (re-rotated
at their positions), against its own cache: mean KL(native || mapped) and top-1 agreement. The
same closed form between a tiny Llama and a tiny Qwen2 (both per-head KV) is the baseline. Random
weights: the numbers compare the latent with per-head KV under one method; they are no quality.

Hybrids (Qwen3-Next: 3 linear-attention layers per full one; Jamba: one attention layer per 8):
a recurrent layer's state after the context depends on its inputs at every context token, which
are the outputs of every earlier layer; so the native work a translated cache still needs is the
target's prefill through its last recurrent layer. Printed: that share of the layers at the
published layer pattern, and the time of a forward through it beside the whole prefill (tiny
widths, the published depth and pattern, 128 tokens, CPU, best of three runs each).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))  # tiny_models: the same models the tests run

N_FIT, N_HELD, LENGTH, CONTEXT = 8, 8, 48, 40
TOKENS = 128  # the hybrids' timed prefill


def _deepseek_rotation(model):
    """(rotate, unrotate) of DeepSeek's shared rotary key k_rot [B, 1, T, dr] at positions [T]: its
    projection's channels are interleaved pairs, but `apply_rotary_pos_emb_interleave` writes the
    rotated key de-interleaved, so the cache holds it in rotate_half's layout."""
    from bridgecache.kv.rope import rotate, unrotate

    rotary = model.model.rotary_emb

    def turn(x, positions, how):
        cos, sin = rotary(torch.zeros(1), positions[None])
        return how(x.float(), cos.float(), sin.float())

    return (lambda x, p: turn(x, p, rotate)), (lambda x, p: turn(x, p, unrotate))


def parts(model, ids):
    """Per layer, the position-free parts of `model`'s cache of `ids` [1, T]: a list of tensors
    [T, width] per layer (per-head KV: un-rotated keys, values; MLA: latent, un-rotated k_rot)."""
    from bridgecache.kv.capture import capture_kv

    positions = torch.arange(ids.shape[1])
    if model.config.model_type == "deepseek_v3":
        cache = model(ids, use_cache=True).past_key_values
        _, unrotate = _deepseek_rotation(model)
        return [[layer.keys[0, 0], unrotate(layer.values, positions)[0, 0]] for layer in cache.layers]
    kv = capture_kv(model, ids)
    return [
        [
            kv.unrotated_keys(i)[0].transpose(0, 1).flatten(1).float(),
            kv.values[i][0].transpose(0, 1).flatten(1),
        ]
        for i in range(len(kv.keys))
    ]


def cache_of(model, layers, ids):
    """A DynamicCache of `model` holding `layers` (parts per layer, [T, width]) re-rotated at 0..T-1."""
    from transformers import DynamicCache

    from bridgecache.kv.rope import RopeTables, rotate

    t = ids.shape[1]
    positions = torch.arange(t)
    cache = DynamicCache(config=model.config)
    if model.config.model_type == "deepseek_v3":
        rotate_k, _ = _deepseek_rotation(model)
        for i, (latent, k_rot) in enumerate(layers):
            cache.update(latent[None, None], rotate_k(k_rot[None, None], positions), i)
        return cache
    config = model.config
    heads, dim = (
        config.num_key_value_heads,
        getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads,
    )
    tables = RopeTables.from_model(model)
    for i, (keys, values) in enumerate(layers):
        k = keys.view(t, heads, dim).transpose(0, 1)[None]
        cos, sin = tables.cos_sin(i, positions)
        cache.update(rotate(k, cos, sin), values.view(t, heads, dim).transpose(0, 1)[None], i)
    return cache


def fit_and_score(source, target, seed: int = 0) -> dict:
    """The closed-form map source -> target (module docstring) and its scores."""
    gen = torch.Generator().manual_seed(seed)
    ids = [torch.randint(3, 300, (1, LENGTH), generator=gen) for _ in range(N_FIT + N_HELD)]
    with torch.no_grad():
        src = [parts(source, x) for x in ids]
        tgt = [parts(target, x) for x in ids]
    ls, lt = len(src[0]), len(tgt[0])
    weights, r2 = [], [[] for _ in tgt[0][0]]
    for layer in range(lt):
        s_layer = round(layer * (ls - 1) / max(lt - 1, 1))
        x = [torch.cat([*src[n][s_layer], torch.ones(LENGTH, 1)], 1) for n in range(len(ids))]
        xf = torch.cat(x[:N_FIT]).double()
        gram = xf.T @ xf
        ridge = 1e-3 * gram.diagonal().mean() * torch.eye(gram.shape[0], dtype=torch.float64)
        maps = []
        for p in range(len(tgt[0][layer])):
            yf = torch.cat([tgt[n][layer][p] for n in range(N_FIT)]).double()
            w = torch.linalg.solve(gram + ridge, xf.T @ yf)
            maps.append(w)
            xh = torch.cat(x[N_FIT:]).double()
            yh = torch.cat([tgt[n][layer][p] for n in range(N_FIT, len(ids))]).double()
            resid = ((xh @ w - yh) ** 2).sum()
            r2[p].append(float(1 - resid / ((yh - yh.mean(0)) ** 2).sum()))
        weights.append((s_layer, maps))
    kl, agree = [], []
    with torch.no_grad():
        for n in range(N_FIT, len(ids)):
            context, follow = ids[n][:, :CONTEXT], ids[n][:, CONTEXT:]
            src_parts = parts(source, context)
            mapped = []
            for s_layer, maps in weights:
                x = torch.cat([*src_parts[s_layer], torch.ones(CONTEXT, 1)], 1).double()
                mapped.append([(x @ w).float() for w in maps])
            native = target(ids[n]).logits[0, CONTEXT - 1 : -1]
            cache = cache_of(target, mapped, context)
            position = torch.arange(CONTEXT - 1, LENGTH - 1)[None]
            last = torch.cat([context[:, -1:], follow[:, :-1]], 1)
            cache.crop(-1)  # the last context token is read again, as a query
            got = target(last, past_key_values=cache, position_ids=position, use_cache=True).logits[0]
            p, q = native.log_softmax(-1), got.log_softmax(-1)
            kl.append(float((p.exp() * (p - q)).sum(-1).mean()))
            agree.append(float((native.argmax(-1) == got.argmax(-1)).float().mean()))
    return {
        "r2": [sum(v) / len(v) for v in r2],
        "kl": sum(kl) / len(kl),
        "top1": sum(agree) / len(agree),
    }


def mla_rows() -> list[str]:
    from tiny_models import tiny_architecture, tiny_model

    deepseek = tiny_architecture("deepseek_v3 (MLA)")
    ids = torch.randint(3, 300, (1, 12), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        cache = deepseek(ids, use_cache=True).past_key_values
    layer = cache.layers[0]
    _, unrotate = _deepseek_rotation(deepseek)
    twice = torch.cat([ids[:, :6], ids[:, :6]], 1)
    with torch.no_grad():
        again = deepseek(twice, use_cache=True).past_key_values.layers[0]
    k_rot = unrotate(again.values, torch.arange(12))[0, 0]
    moved = float((k_rot[:6] - k_rot[6:]).abs().max() / k_rot.abs().max())
    c = deepseek.config
    v3 = __import__("transformers").DeepseekV3Config()  # the published DeepSeek V3 sizes
    cached = v3.kv_lora_rank + v3.qk_rope_head_dim
    expanded = v3.num_attention_heads * (v3.qk_nope_head_dim + v3.qk_rope_head_dim + v3.v_head_dim)
    lines = [
        f"DeepSeek V3 (tiny: {c.num_attention_heads} heads, kv_lora_rank {c.kv_lora_rank}, qk_nope "
        f"{c.qk_nope_head_dim}, qk_rope {c.qk_rope_head_dim}, v {c.v_head_dim}): transformers' cache "
        f"layer 0 keys {tuple(layer.keys.shape)} (the latent), values {tuple(layer.values.shape)} (k_rot, "
        f"rotated, written de-interleaved: un-rotated in rotate_half's layout it is position-free, "
        f"moving {moved:.1e} of its largest entry when read 6 positions later)",
        "",
        f"Published DeepSeek V3 (DeepseekV3Config defaults): the cache keeps {v3.kv_lora_rank} + "
        f"{v3.qk_rope_head_dim} = {cached} numbers per token and layer; the per-head keys and values "
        f"its attention expands them to are {v3.num_attention_heads} x ({v3.qk_nope_head_dim} + "
        f"{v3.qk_rope_head_dim} + {v3.v_head_dim}) = {expanded} ({expanded / cached:.0f}x).",
        "",
        "| source -> target | held-out R^2 per target part (mean over layers) | next-token KL, native "
        "vs mapped cache | top-1 agreement |",
        "|---|---|---|---|",
    ]
    llama, qwen = tiny_model("llama"), tiny_model("qwen2")
    pairs = [
        ("llama -> qwen2 (baseline)", llama, qwen, "keys, values"),
        ("qwen2 -> llama (baseline)", qwen, llama, "keys, values"),
        ("qwen2 -> deepseek_v3", qwen, deepseek, "latent, k_rot"),
        ("deepseek_v3 -> qwen2", deepseek, qwen, "keys, values"),
    ]
    for label, source, target, names in pairs:
        result = fit_and_score(source, target)
        r2 = ", ".join(f"{n} {v:.3f}" for n, v in zip(names.split(", "), result["r2"]))
        lines.append(f"| {label} | {r2} | {result['kl']:.4f} | {result['top1']:.3f} |")
    return lines


def hybrid_rows() -> list[str]:
    import transformers
    from transformers import AutoModelForCausalLM

    small = dict(
        vocab_size=320, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, max_position_embeddings=4096, attn_implementation="eager",
    )  # fmt: skip
    published = {
        "qwen3_next (48 layers)": ("Qwen3NextConfig", dict(num_experts=4, num_experts_per_tok=2)),
        "jamba (32 layers)": (
            "JambaConfig",
            dict(num_experts=4, num_experts_per_tok=2, use_mamba_kernels=False),
        ),
    }
    lines = [
        "| hybrid (published pattern, tiny widths) | recurrent layers | last recurrent layer | share of "
        "layers a translated cache still runs | forward through it / whole prefill "
        "(128 tokens, CPU, best of 3) |",
        "|---|---|---|---|---|",
    ]
    ids = torch.randint(3, 300, (1, TOKENS), generator=torch.Generator().manual_seed(6))
    for label, (name, extra) in published.items():
        defaults = getattr(transformers, name)()
        depth = defaults.num_hidden_layers
        config = getattr(transformers, name)(**(small | extra | dict(num_hidden_layers=depth)))
        types = list(getattr(config, "layer_types", None) or config.layers_block_type)
        recurrent = [i for i, t in enumerate(types) if t in ("linear_attention", "mamba")]
        last = recurrent[-1]
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config).eval()
        stack = model.model.layers
        times = {}
        with torch.no_grad():
            for count in (depth, last + 1) * 3:  # three each, alternating: the best of three
                model.model.layers = torch.nn.ModuleList(list(stack)[:count])
                model.model.config.num_hidden_layers = count
                model.model(ids[:, :16])  # warm
                start = time.perf_counter()
                model.model(ids)
                times[count] = min(times.get(count, float("inf")), time.perf_counter() - start)
        model.model.layers = stack
        lines.append(
            f"| {label} | {len(recurrent)} of {depth} | {last} | {(last + 1) / depth:.3f} | "
            f"{times[last + 1]:.2f} s / {times[depth]:.2f} s = {times[last + 1] / times[depth]:.3f} |"
        )
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=None, help="write the markdown report here (default: print only)")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    import datetime
    import platform
    import subprocess
    import warnings

    import transformers

    warnings.filterwarnings("ignore")
    torch.set_num_threads(args.threads)
    transformers.logging.set_verbosity_error()
    mla, hybrid = "\n".join(mla_rows()), "\n".join(hybrid_rows())
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    text = REPORT.format(
        when=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        commit=commit.stdout.strip() or "unknown",
        device=f"CPU {platform.machine()}, {args.threads} thread(s)",
        torch=torch.__version__,
        transformers=transformers.__version__,
        mla=mla,
        hybrid=hybrid,
    )
    if args.out:
        Path(args.out).write_text(text)
    print(text)


REPORT = """# Latent caches (MLA) and hybrids: refused, and why (measured)

Generated by `python benchmarks/latent_hybrid.py --out docs/latent-and-hybrid.md` ({when}, code at
commit {commit}, {device}, torch {torch}, transformers {transformers}). Method: see the script's
docstring. Both are refused by name where they enter (`model_spec`; docs/architectures.md).

## MLA (DeepSeek V2 / V3, Kimi K2)

{mla}

What the cache holds: per layer, transformers keeps the latent (the keys slot, `kv_lora_rank`
wide, position-free) and the shared rotary key (the values slot, `qk_rope_head_dim` wide, rotated
in rotate_half's layout although the projection's channels are interleaved pairs), and expands
them to per-head keys and values inside every attention call. A closed-form map into the latent
(least squares from the source's position-free keys and values to the target's latent and
un-rotated rotary key) runs both ways. On random weights no map generalises (held-out R^2 below
0 in every row, the baselines' too), so the rows compare only with each other: the latent and the
rotary key fit no worse than one per-head model's keys and values fit from another's, and the
target reading a mapped latent strays from its own next tokens no more than a per-head target
does. The method is not what stands in the way; translating into the expanded per-head keys and
values instead would store many times the cache (above) and is not what the model reads back.
The runtime is: every bridge map, kernel and buffer assumes keys and values of one head width
(DeepSeek V3: 512 and 64), the rotated part sits in the values slot, and the
native-work pass writes the keys and values its attention receives, which for MLA are the
expanded per-head tensors, not the cached latent. Supporting MLA means a latent layout in
`ModelSpec` (separate key and value widths, a rotated value slot) and a pass that writes the
latent: a follow-up, not a refusal of the method.

## Hybrids (Qwen3-Next, Jamba)

{hybrid}

A recurrent layer's state after the context is a function of its inputs at every context token,
and those are the outputs of every layer before it; so with translated attention layers the
target still runs its prefill through its last recurrent layer, which at the published patterns
is all but at most one layer (the share above). The timed ratio agrees within this shared
machine's noise (the best of three alternating runs each; one layer of 48 is 2% of the prefill,
less than that noise). Translating the attention layers could save only the attention layers
after the last recurrent one, before paying for the translation: no saving, so hybrids are
refused.
"""


if __name__ == "__main__":
    main()
