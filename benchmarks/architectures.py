"""Which architectures bridgecache translates exactly, and which it refuses and why: one tiny
random-weight model of each transformers config class (tests/tiny_models.py ARCHITECTURES),
written as a markdown table.

    python benchmarks/architectures.py [--out docs/architectures.md] [--threads 1]

Per architecture, in float32 on the CPU, over a 30-token context (longer than the window of 8
where the family has one), 5 greedy new tokens:
- the layout `model_spec` reads (sliding layers and window, the rotary layout where it is not
  Llama's half-split over the whole head) or the refusal it raises;
- identity: max |logit difference| between the target's own `generate()` and `generate()` over a
  BridgedCache of the identity bridge, and whether the tokens are equal;
- full refresh: the same for a deliberately wrong bridge (the identity plus N(0, 0.25) noise on
  every map, marked as fitted) under `RefreshConfig(1.0, "deviation")`, beside that bridge's
  difference without refresh (to show it is wrong);
- un-rotation: layer 0's keys depend on the token alone, so once un-rotated (RoPE removed with the
  model's own tables, or none on a layer without RoPE) a token's keys are the same wherever it
  stands: the largest difference between the un-rotated layer-0 keys of 15 tokens read at
  positions 0-14 and again at 15-29, relative to the largest key;
- fit and handoff with a tiny Qwen2, both ways: the held-out attention cosine of each fit (random
  weights: a number that shows the path runs, not a quality) and that `handoff()` generated on
  the bridged route (`route="handoff"`: "auto" may time the target's own prefill faster on a CPU).
Nothing is downloaded; about a minute on one core.
"""

from __future__ import annotations

import argparse
import datetime
import platform
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))  # tiny_models: the same models the tests run

CONTEXT = "The key to the red door is under the third stone of the garden path."


def _generate(model, ids, cache=None):
    import torch

    from bridgecache.compat import cache_kwargs

    kwargs = dict(max_new_tokens=5, do_sample=False, pad_token_id=0, output_logits=True)
    if cache is not None:
        kwargs |= cache_kwargs(model, cache)
    out = model.generate(ids, return_dict_in_generate=True, **kwargs)
    return out.sequences, torch.stack(out.logits)


def _noisy_bridge(model):
    import torch

    from bridgecache.bridge.maps import Bridge

    bridge = Bridge.identity(model)
    generator = torch.Generator().manual_seed(0)
    for layer in bridge.layers:
        for name in ("key_weight", "value_weight"):
            weight = getattr(layer, name)
            weight += 0.5 * torch.randn(weight.shape, generator=generator)
    bridge.method = "fullhead"
    return bridge


def measure(name: str) -> dict:
    """One row of the table (see the module docstring)."""
    from tiny_models import tiny_architecture

    return measure_model(tiny_architecture(name), {"architecture": name})


def measure_model(model, row: dict) -> dict:
    """`row` completed for any tiny model (benchmarks/architecture_probe.py's too): its refusal, or
    its layout, un-rotation, identity, wrong bridge, full refresh and fits with a tiny Qwen2."""
    import torch
    from tiny_models import byte_tokenizer, tiny_model

    from bridgecache import FitConfig, HandoffConfig, RefreshConfig, fit_bridge
    from bridgecache.bridge.maps import Bridge
    from bridgecache.kv.capture import capture_kv
    from bridgecache.models.layout import UnsupportedArchitectureError, layer_chunks
    from bridgecache.models.spec import model_spec
    from bridgecache.runtime.cache import BridgedCache
    from bridgecache.runtime.entry.handoff import handoff

    row = row | {"config": type(model.config).__name__}
    try:
        spec = model_spec(model)
    except UnsupportedArchitectureError as error:
        where = "every layer" if error.layer is None else f"layer {error.layer}"
        return row | {"refused": f"{error.feature}, {where}", "detail": error.detail}
    chunks = layer_chunks(model.config)  # Llama 4: cached as a window, attended within chunks
    sliding = [i for i, t in enumerate(spec.layer_types) if t == "sliding_attention" and not chunks[i]]
    chunked = [i for i, c in enumerate(chunks) if c]
    parts = [f"window {spec.sliding_window} on layers {sliding}"] if sliding else []
    parts += [f"chunks of {chunks[chunked[0]]} on layers {chunked}"] if chunked else []
    row["layout"] = ", ".join(parts) or "full attention"
    kind, rotary_dim = spec.rotary
    if (kind, rotary_dim) != ("half", spec.head_dim):
        row["layout"] += f"; rotary {kind}, {rotary_dim} of {spec.head_dim} channels"
    ids = torch.randint(3, 300, (1, 30), generator=torch.Generator().manual_seed(1))
    native_seq, native = _generate(model, ids)

    def run(bridge, config):
        seq, logits = _generate(
            model, ids, BridgedCache(bridge, capture_kv(model, ids), model, ids, config=config)
        )
        return (logits - native).abs().max().item(), bool(torch.equal(seq, native_seq))

    row["un-rotation"] = unrotation_error(model)
    row["identity"] = run(Bridge.identity(model), HandoffConfig())
    noisy = _noisy_bridge(model)
    row["wrong bridge"] = run(noisy, HandoffConfig(refresh=None))
    row["full refresh"] = run(noisy, HandoffConfig(refresh=RefreshConfig(1.0, "deviation"), route="handoff"))
    fit = dict(
        method="fullhead", layer_support="depth", layers_k=1, num_sequences=4, seq_len=48, heldout_every=2
    )
    tok, qwen = byte_tokenizer(), tiny_model("qwen2")
    names = dict(progress=False, source_name="source", target_name="target")
    for label, (source, target) in (("to qwen2", (model, qwen)), ("from qwen2", (qwen, model))):
        bridge = fit_bridge(source, target, tok, tok, FitConfig(**fit), **names)
        result = handoff(
            bridge, source, target, CONTEXT, " Where?", source_tokenizer=tok, target_tokenizer=tok,
            max_new_tokens=3, do_sample=False, config=HandoffConfig(route="handoff"),
        )  # fmt: skip  # the bridged route: on a CPU, "auto" may time the target's own prefill faster
        ran = result.output_ids.shape[-1] > 0
        row[label] = (bridge.calibration["heldout_scores"]["mean"], ran)
    return row


def unrotation_error(model) -> float:
    """max |k(t at p) - k(t at p + 15)| / max |k| over layer 0's un-rotated keys of 15 tokens
    read twice in a row (see the module docstring)."""
    import torch

    from bridgecache.kv.capture import capture_kv

    half = torch.randint(3, 300, (1, 15), generator=torch.Generator().manual_seed(2))
    keys = capture_kv(model, torch.cat([half, half], 1)).unrotated_keys(0).float()
    return ((keys[:, :, :15] - keys[:, :, 15:]).abs().max() / keys.abs().max()).item()


def _exact(pair) -> str:
    diff, same = pair
    return f"{diff:.1e}, tokens {'equal' if same else 'DIFFER'}"


def table(rows: list[dict]) -> str:
    exact = [r for r in rows if "refused" not in r]
    refused = [r for r in rows if "refused" in r]
    lines = [
        "| architecture | config class | layout read | un-rotation error | identity: max abs logit diff "
        "| wrong bridge (no refresh) | wrong bridge, full refresh | fit + handoff to / from Qwen2 |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in exact:
        fits = " / ".join(
            f"{c:.3f}{'' if ran else ' (no output)'}" for c, ran in (r["to qwen2"], r["from qwen2"])
        )
        lines.append(
            f"| {r['architecture']} | {r['config']} | {r['layout']} | {r['un-rotation']:.1e} | "
            f"{_exact(r['identity'])} | {r['wrong bridge'][0]:.1e} | {_exact(r['full refresh'])} | {fits} |"
        )
    lines += [
        "",
        "| architecture | config class | refused at entry: feature, where | detail |",
        "|---|---|---|---|",
    ]
    lines += [f"| {r['architecture']} | {r['config']} | {r['refused']} | {r['detail']} |" for r in refused]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=str(ROOT / "docs" / "architectures.md"))
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()

    import torch
    import transformers
    from tiny_models import ARCHITECTURES
    from tqdm.auto import tqdm

    torch.set_num_threads(args.threads)
    transformers.logging.set_verbosity_error()
    rows = [measure(name) for name in tqdm(ARCHITECTURES, desc="architectures")]
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    text = HEADER.format(
        when=when,
        commit=commit.stdout.strip() or "unknown",
        device=f"CPU {platform.machine()}, {args.threads} thread(s)",
        torch=torch.__version__,
        transformers=transformers.__version__,
        table=table(rows),
    )
    Path(args.out).write_text(text)
    print(text)


HEADER = """# Architectures: exact, or refused by name

Generated by `python benchmarks/architectures.py` ({when}, code at commit {commit}, {device},
torch {torch}, transformers {transformers}); the same tiny random-weight models as
`tests/models/test_architectures.py` (4 layers, 4 query / 2 KV heads of 16 dims, a window of 8 where the
family has one), a 30-token context, 5 greedy new tokens, float32. Method: see the script's
docstring.

These rows are configs the developers wrote. A held-out probe builds every other causal-LM
config class in transformers' registry from the class's own defaults by one generic shrink (no
tuning per family), pairs each with a tiny Qwen2 both ways and sorts it into exact, refused at
entry, silently wrong or a crash: `python benchmarks/architecture_probe.py`, written to
[architecture-probe.md](architecture-probe.md) (its date, counts and findings there).

A supported architecture is exact: through the identity bridge, and with every translated token
refreshed from a deliberately wrong bridge, the target generates its own tokens (max |logit
difference| < 1e-4; the wrong bridge alone is off by the figure shown). The un-rotation error is
how far a token's un-rotated layer-0 keys move when it is read 15 positions later (0 up to
rounding: the keys a bridge maps are position-free). The fit + handoff column gives the held-out
attention cosine (mean over layers) of a Full-Head fit each way; the weights are random, so it
shows that the path runs, not a quality. An identity bridge never goes through the key-norm
projection (`HandoffConfig(key_norm=True)`, the default, which restores the norm a fitted map
loses), so the identity figures of the key-normed families (Qwen3, Gemma 3, OLMo 2, OLMo 3,
EXAONE 4, ...) are the target's own keys; the wrong bridge, marked as fitted, is projected.

An unsupported architecture is refused where it enters (`model_spec`, which `capture_kv`,
`Bridge.identity`, `fit_bridge` and `BridgedCache` call before any model runs) with an
`UnsupportedArchitectureError` naming the layer, the feature and what is supported.

{table}

Attention that is not in the cache: GPT-OSS adds a learned sink logit per head to every softmax
(a column with no value, transformers' eager attention, the only one it supports), and Llama 4's
chunked layers attend within chunks of `attention_chunk_size` counted from each row's first real
token (transformers caches them as a window of the chunk size). Their keys and values are
ordinary, so bridgecache's own attention does what the model's does: the native-work pass's
column attention (the Triton kernel and its reference take the sink logits and the chunk), the
source's reading and the fit's attention weights. Llama 4's NoPE layers scale their queries by a
temperature of the position; our forwards give it at the queries' true columns. The first Llama 4
row has NoPE on every layer (the chunked ones included); the second is its published pattern:
RoPE from one complex table (freqs_cis, interleaved pairs (2j, 2j + 1), read as such by applying
its own `apply_rotary_emb` to [0, 1, 2, 3]) with a weightless qk-norm after the rotation on the
chunked layers, NoPE on every fourth.

Rotary layouts: a bridge maps keys in un-rotated space, so it must know which channels the model's
RoPE rotates together. `model_spec` reads a `RotaryLayout` from the model's own code (its
`rotate_half` applied to [0, 1, 2, 3]: half-split (j, j + R/2) or interleaved (2j, 2j + 1) pairs;
R = head_dim x `partial_rotary_factor` leading channels, the rest pass through), records it in the
bridge file, and the kernels take it as compile-time constants: partial (Phi-4-mini 0.75, Phi and
Persimmon 0.5, GPT-NeoX 0.25) and interleaved (Cohere, Cohere 2, Helium; GLM and GLM-4 both, 0.5)
are exact above; GPT-OSS's rotary module returns each frequency once (half-width tables) and Llama
4's a complex table, which the tables read as such. StableLM (partial 0.25) and Nemotron (0.5) are
exact too, although their decoder layers call `self_attn` without the forward's extra keywords
(transformers 5.25): bridgecache's own attention reads its mask from a context variable set for
the duration of its forward (`interop.attention.attending`), not from a keyword. DeepSeek's
`rope_interleave` permutes channels before a half-split rotation; only MLA models use it (refused
above). Models without rotary embeddings (GPT-2's learned positions, Bloom's ALiBi) have no
un-rotated space. MLA (DeepSeek V2/V3, Kimi K2): transformers caches one latent per token as keys
and the shared rotary key as values, of different widths; hybrids (Qwen3-Next, Jamba) keep a
recurrent state whose native computation needs nearly the whole prefill. Both decisions, with
their measurements: docs/latent-and-hybrid.md (`python benchmarks/latent_hybrid.py`).

At the sizes users run: one model of each supported family at its published config (Llama-3.1-8B,
Mistral-7B, Qwen3-8B, Gemma-2-9B, Gemma-3-4B, Phi-3-mini-4k, OLMo-2-7B, Granite-3.1-8B, SmolLM3-3B,
StarCoder2-7B; random weights, bf16, CUDA) is timed beside the target's own prefill at 4K and 16K
tokens by `python benchmarks/gpu_families.py`, with a full refresh checked against native:
benchmarks/reports/families-2026-12-06.md. The script also builds Phi-4-mini, Command R7B,
GPT-OSS-20B, Llama-4-Scout's text layers (8 of 48), Pythia-6.9B and StableLM-2-1.6B at their
published configs (`--families new`); exact at tiny widths on the CPU, not yet timed on a GPU
(that report's last section).
"""


if __name__ == "__main__":
    main()
