"""A held-out architecture probe: every causal-LM config class in transformers' own registry that
tests/tiny_models.py ARCHITECTURES does not cover (the ones nobody tuned), built mechanically
from the class's defaults by one generic shrink, paired with a tiny Qwen2 both ways, and sorted
into exactly one outcome.

    python benchmarks/architecture_probe.py [--out docs/architecture-probe.md] [--only TYPE ...]

Per model type of `MODEL_FOR_CAUSAL_LM_MAPPING_NAMES` not in ARCHITECTURES:
- build: the config class's defaults with `SHRINK` applied to the fields the class has (aliases
  such as GPT-2's `n_embd` through the class's own attribute map), the fields of `FEATURES` set
  only where the default sets them (experts, latent ranks, windows, chunks, rotary widths), the
  token ids the byte tokenizer's, every per-layer list of the defaults cycled to `LAYERS` layers
  and every count of layers scaled to them; only fields the class takes, never ones it derives;
  random weights (seed 0), float32, eager attention. Encoder-decoder and composite (multimodal)
  configs are not probed (their text part is, where it has its own entry); a config the rule
  cannot build, a model transformers cannot build or that cannot `generate()` on its own, is
  listed as "could not build" and is not a probe row: it says nothing about bridgecache.
- outcome, one of:
  "refused at entry": `model_spec` or `Bridge.identity` raises bridgecache's
  UnsupportedArchitectureError (or another ValueError/TypeError raised by bridgecache's own code)
  before the model runs;
  "exact": benchmarks/architectures.py's checks (`measure_model`) pass: identity bridge and a full
  refresh of a deliberately wrong bridge reproduce the model's own generate() (max |logit diff|
  < 1e-4, tokens equal), un-rotated layer-0 keys are position-free (< 1e-5 of the largest key:
  a bridge maps keys in that space), and fit + handoff with the tiny Qwen2 run both ways;
  "SILENTLY WRONG": no refusal, but one of those numbers is off;
  "CRASH inside torch/transformers": an exception whose innermost frame is in torch or
  transformers; "crash in bridgecache": any other exception.
Nothing is downloaded; a few minutes on one core.
"""

from __future__ import annotations

import argparse
import datetime
import platform
import subprocess
import sys
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))  # tiny_models: the byte tokenizer and the tiny Qwen2
sys.path.insert(0, str(ROOT / "benchmarks"))  # architectures: the checks, imported, not copied

LAYERS = 4
SHRINK = dict(
    num_hidden_layers=LAYERS, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
    intermediate_size=128, vocab_size=320, max_position_embeddings=512,
)  # fmt: skip
# Sub-sizes shrunk only where the class's default sets them (a feature it has).
FEATURES = dict(
    num_experts=4, num_local_experts=4, n_routed_experts=4, moe_num_experts=4, num_experts_per_tok=2,
    moe_intermediate_size=32, shared_expert_intermediate_size=32, n_shared_experts=1,
    kv_lora_rank=16, q_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16,
    sliding_window=8, attention_chunk_size=8, rotary_dim=8,
)  # fmt: skip
TOKENS = dict(pad_token_id=0, bos_token_id=256, eos_token_id=257)  # the byte tokenizer's
MAX_PARAMETERS = 20_000_000  # the shrink missed a size field: not a tiny model
OUTCOMES = (
    "exact", "refused at entry", "SILENTLY WRONG", "CRASH inside torch/transformers", "crash in bridgecache",
)  # fmt: skip
UNROTATION_LIMIT = 1e-5  # relative to the largest key, as tests/models/test_architectures.py
SHIFTED_LIMIT = 1e-4  # the same, every layer: float32 rounding grows with depth


class NotBuilt(Exception):
    """The generic rule or transformers could not give a working tiny model of this class."""


def held_out() -> list[tuple[str, str]]:
    """(model type, causal-LM class name) of the registry's entries that ARCHITECTURES lacks."""
    import transformers
    from tiny_models import ARCHITECTURES
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    covered = {getattr(transformers, name).model_type for name, _ in ARCHITECTURES.values()}
    return [(t, c) for t, c in sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.items()) if t not in covered]


def tiny_config(model_type: str, derived: tuple[str, ...] = ()):
    """The class's defaults under the generic shrink, leaving the `derived` fields to the class;
    raises NotBuilt with the reason to skip."""
    from transformers import CONFIG_MAPPING

    cls = CONFIG_MAPPING[model_type]
    default = cls()
    if getattr(default, "is_encoder_decoder", False):
        raise NotBuilt("encoder-decoder: not probed")
    if default.get_text_config() is not default:
        text = default.get_text_config().model_type
        raise NotBuilt(f"composite (multimodal) config: not probed; its text config is {text!r}")
    fields = _declared(cls)
    kwargs = {k: v for k, v in SHRINK.items() if k in fields and k not in derived}
    for key, value in FEATURES.items():
        current = getattr(default, key, None)
        if key in fields and isinstance(current, int) and not isinstance(current, bool):
            kwargs[key] = min(value, current) if key == "num_experts_per_tok" else value
    kwargs |= {k: v for k, v in TOKENS.items() if k in fields}
    layers = getattr(default, "num_hidden_layers", None)
    for key, value in default.to_dict().items():
        if key in kwargs or key not in fields or not layers:
            continue
        if isinstance(value, list) and len(value) == layers:  # per layer: the pattern's first LAYERS
            kwargs[key] = [value[i % len(value)] for i in range(LAYERS)]
        elif _layer_count(key, value, layers):  # Gemma 3n's num_kv_shared_layers: scaled
            kwargs[key] = max(1, round(value * LAYERS / layers))
        elif key.startswith("vocab_size") and isinstance(value, int):  # per-layer inputs' vocabulary
            kwargs[key] = SHRINK["vocab_size"]
    return cls(**kwargs, attn_implementation="eager")


def _layer_count(key: str, value, layers: int) -> bool:
    """Whether a config field counts some of the layers (num_..._layers, below the layer count)."""
    counted = key.startswith("num_") and key.endswith("_layers") and isinstance(value, int)
    return counted and not isinstance(value, bool) and 0 < value < layers


def _declared(cls) -> set[str]:
    """The fields a config class takes (its dataclass fields or __init__ parameters, and the
    aliases of its attribute map); not what it derives (Falcon's `num_key_value_heads` follows
    `multi_query`: setting it would give a config its own model contradicts)."""
    import dataclasses
    import inspect

    names = {f.name for f in dataclasses.fields(cls)} if dataclasses.is_dataclass(cls) else set()
    names |= set(inspect.signature(cls.__init__).parameters)
    return names | set(getattr(cls, "attribute_map", {}))


def build(model_type: str):
    """A tiny float32 model of `model_type` (seed 0) that generates on its own, or NotBuilt. Where
    the shrink's head_dim does not fit the class (latent or other derived head sizes), the class
    derives it, then its KV heads too (the same retries for every class)."""
    errors = []
    for derived in ((), ("head_dim",), ("head_dim", "num_key_value_heads")):
        try:
            return _build(model_type, derived)
        except NotBuilt as error:
            if not str(error).startswith(("config:", "model:")):
                raise
            errors.append(error)
    raise errors[0]


def _build(model_type: str, derived: tuple[str, ...]):
    import torch
    from transformers import AutoModelForCausalLM

    try:
        config = tiny_config(model_type, derived)
    except NotBuilt:
        raise
    except Exception as error:  # noqa: BLE001 - any failure of the generic rule
        raise NotBuilt(f"config: {type(error).__name__}: {_short(error)}") from error
    try:
        with torch.device("meta"):
            size = sum(p.numel() for p in AutoModelForCausalLM.from_config(config).parameters())
    except Exception as error:  # noqa: BLE001 - transformers cannot build it: not about bridgecache
        raise NotBuilt(f"model: {type(error).__name__}: {_short(error)}") from error
    if size > MAX_PARAMETERS:
        raise NotBuilt(f"the generic shrink leaves {size / 1e6:.0f}M parameters")
    try:
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
        ids = torch.randint(3, 256, (1, 12), generator=torch.Generator().manual_seed(0))
        model.generate(ids, max_new_tokens=2, do_sample=False, pad_token_id=0)
    except Exception as error:  # noqa: BLE001 - transformers cannot run it: not about bridgecache
        raise NotBuilt(f"model: {type(error).__name__}: {_short(error)}") from error
    return model


def probe(model_type: str, class_name: str) -> dict:
    """One row: model type, classes, outcome and its detail (see the module docstring)."""
    from architectures import measure_model

    from bridgecache.bridge.maps import Bridge
    from bridgecache.models.spec import model_spec

    row = {"model_type": model_type, "class": class_name}
    try:
        model = build(model_type)
    except NotBuilt as reason:
        return row | {"outcome": "could not build", "detail": str(reason)}
    row["config"] = type(model.config).__name__
    ran = []
    hook = model.register_forward_pre_hook(lambda *a: ran.append(1))
    try:
        model_spec(model)
        Bridge.identity(model)
    except (ValueError, TypeError) as error:
        if _frame(error)[0] == "bridgecache" and not ran:
            return row | {"outcome": "refused at entry", "detail": _short(error, 400)}
        return row | _crash(error)
    except Exception as error:  # noqa: BLE001
        return row | _crash(error)
    finally:
        hook.remove()
    try:
        judged = _judge(measure_model(model, {}) | {"shifted": shifted_unrotation(model)})
    except Exception as error:  # noqa: BLE001
        return row | _crash(error)
    return row | judged


def shifted_unrotation(model, shift: int = 15) -> float:
    """max over layers of |un-rotated keys at positions p - at p + shift| / max |keys|, 12 tokens.
    With every position moved by one shift, a RoPE model's hidden states stay the same (its
    attention sees relative positions only), so every layer's un-rotated keys must too: checks
    each layer's rotary tables, layout and RoPE / no-RoPE flag, with the tables a bridge rebuilds
    from the model's spec (layer 0's check in architectures.py sees the first layer only)."""
    import torch
    from transformers import DynamicCache

    from bridgecache.compat import cache_kwargs
    from bridgecache.kv.capture import cache_to_layers
    from bridgecache.kv.rope import RopeTables, unrotate
    from bridgecache.models.spec import model_spec

    tables = RopeTables.from_spec(model_spec(model))
    ids = torch.randint(3, 256, (1, 12), generator=torch.Generator().manual_seed(3))
    unrotated = []
    for start in (0, shift):
        positions = torch.arange(start, start + 12)[None]
        cache = DynamicCache()
        with torch.no_grad():
            model(input_ids=ids, position_ids=positions, use_cache=True, **cache_kwargs(model, cache))
        keys = cache_to_layers(cache)[0]
        unrotated.append(
            [unrotate(k.float(), *tables.cos_sin(i, positions), tables.layout) for i, k in enumerate(keys)]
        )
    return max(((a - b).abs().max() / a.abs().max()).item() for a, b in zip(*unrotated))


def _judge(m: dict) -> dict:
    (identity, same), (refresh, same_refresh) = m["identity"], m["full refresh"]
    fits = [m["to qwen2"], m["from qwen2"]]
    detail = (
        f"{m['layout']}; identity {identity:.1e}{'' if same else ' tokens DIFFER'}, full refresh "
        f"{refresh:.1e}{'' if same_refresh else ' tokens DIFFER'} (wrong bridge {m['wrong bridge'][0]:.1e}), "
        f"un-rotation {m['un-rotation']:.1e}, every layer shifted {m['shifted']:.1e}, fit to/from Qwen2 "
        + " / ".join(f"{c:.3f}{'' if ok else ' (no output)'}" for c, ok in fits)
    )
    wrong = (
        not same
        or not same_refresh
        or not identity < 1e-4
        or not refresh < 1e-4
        or not m["un-rotation"] < UNROTATION_LIMIT
        or not m["shifted"] < SHIFTED_LIMIT
    )
    if wrong:
        return {"outcome": "SILENTLY WRONG", "detail": detail}
    if not all(ok for _, ok in fits):
        return {"outcome": "crash in bridgecache", "detail": "handoff generated nothing; " + detail}
    return {"outcome": "exact", "detail": detail}


def _frame(error: BaseException) -> tuple[str, str]:
    """(where, "file:line in function") of the innermost frame of an exception's traceback that is
    in torch, transformers or this repository (the standard library's, importlib's, are skipped):
    where is "torch/transformers", "bridgecache" or "other"."""
    import bridgecache

    library = Path(bridgecache.__file__).resolve().parent.parent  # bridgecache, kernels, tokenalign
    for frame in reversed(traceback.extract_tb(error.__traceback__)):
        path = Path(frame.filename)
        if "torch" in path.parts or "transformers" in path.parts:
            shown, where = "/".join(path.parts[-3:]), "torch/transformers"
        elif path.is_relative_to(library) and path.parent.name not in ("benchmarks", "tests"):
            shown, where = str(path.relative_to(library)), "bridgecache"
        else:
            continue
        return where, f"{shown}:{frame.lineno} in {frame.name}"
    return "other", "?"


def _crash(error: BaseException) -> dict:
    where, frame = _frame(error)
    outcome = "CRASH inside torch/transformers" if where == "torch/transformers" else "crash in bridgecache"
    inner = next(
        (f for f in reversed(traceback.extract_tb(error.__traceback__)) if "/bridgecache/" in f.filename),
        None,
    )
    via = ""
    if inner is not None and where != "bridgecache":
        via = f"; from {Path(inner.filename).name}:{inner.lineno} in {inner.name}"
    return {"outcome": outcome, "detail": f"{type(error).__name__}: {_short(error)} (at {frame}{via})"}


def _short(error, limit: int = 240) -> str:
    text = " ".join(str(error).split()).replace("|", "/")
    return text if len(text) <= limit else text[: limit - 3] + "..."


def table(rows: list[dict]) -> str:
    probed = [r for r in rows if r["outcome"] in OUTCOMES]
    counts = {o: sum(r["outcome"] == o for r in probed) for o in OUTCOMES}
    lines = [f"{len(probed)} configs probed:", ""]
    lines += [f"- {o}: {n}" for o, n in counts.items()]
    lines += ["", "| model type | config class | outcome | detail |", "|---|---|---|---|"]
    for outcome in OUTCOMES:
        lines += [
            f"| {r['model_type']} | {r['config']} | {r['outcome']} | {r['detail']} |"
            for r in probed
            if r["outcome"] == outcome
        ]
    skipped = [r for r in rows if r["outcome"] not in OUTCOMES]
    lines += [
        "",
        f"Not probed ({len(skipped)}): the generic rule or transformers could not give a working tiny "
        "model (says nothing about bridgecache), or an encoder-decoder or composite config.",
        "",
        "| model type | causal-LM class | why not |",
        "|---|---|---|",
    ]
    lines += [f"| {r['model_type']} | {r['class']} | {r['detail']} |" for r in skipped]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=str(ROOT / "docs" / "architecture-probe.md"))
    parser.add_argument("--only", nargs="*", help="these model types only (no file written)")
    args = parser.parse_args()

    import logging
    import warnings

    import torch
    import transformers
    from tqdm.auto import tqdm

    torch.set_num_threads(1)
    transformers.logging.set_verbosity_error()
    logging.getLogger("bridgecache").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")
    entries = [(t, c) for t, c in held_out() if not args.only or t in args.only]
    rows = []
    for model_type, class_name in tqdm(entries, desc="held-out architectures"):
        rows.append(probe(model_type, class_name))
        tqdm.write(f"{model_type}: {rows[-1]['outcome']}: {rows[-1]['detail'][:200]}")
    if args.only:
        return
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    text = HEADER.format(
        when=when,
        commit=commit.stdout.strip() or "unknown",
        device=f"CPU {platform.machine()}, 1 thread",
        torch=torch.__version__,
        transformers=transformers.__version__,
        layers=LAYERS,
        table=table(rows),
    )
    Path(args.out).write_text(text)
    print(text)


HEADER = """# Held-out architecture probe

Generated by `python benchmarks/architecture_probe.py` ({when}, code at commit {commit}, {device},
torch {torch}, transformers {transformers}). The configs are nobody's choice: every causal-LM
config class in transformers' registry (`MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`) whose model type
tests/tiny_models.py ARCHITECTURES does not cover (docs/architectures.md holds those), built from
the class's own defaults by one generic shrink ({layers} layers, hidden size 64, 4 heads, 2 KV heads
and head_dim 16 where the class has the fields, intermediate size 128, vocabulary 320, 512
positions, eager attention; experts, latent ranks, windows (8), chunks (8) and rotary widths (8)
shrunk only where the defaults set them; per-layer lists cycled to {layers} layers, counts of
layers scaled to {layers}, per-layer vocabularies to 320), random weights, float32. No tuning per
architecture. Each model is paired with the tiny Qwen2 of tests/tiny_models.py both ways. Method
and outcomes: see the script's docstring; the checks are benchmarks/architectures.py's.

"exact": identity bridge and full refresh of a deliberately wrong bridge within 1e-4 of the
model's own generate() (tokens equal), un-rotated layer-0 keys position-free within 1e-5 of the
largest key and every layer's within 1e-4 with all positions shifted by 15 (each layer's rotary
tables, pairing and RoPE / no-RoPE flag as a bridge rebuilds them from the spec), fit + handoff
(bridged route) with the tiny Qwen2 both ways (the numbers: held-out attention cosine of
random-weight fits, which shows the path runs, not a quality). "refused at entry": bridgecache's
named error before the model runs. Anything else is a finding.

{table}

An identity bridge does not go through the key-norm projection (`HandoffConfig(key_norm=True)`,
the default, which puts every translated key at unit RMS after the target's key norm): the
projection restores what a fitted map loses, and an identity map loses nothing. At commit
db66f91, before that rule, FlexOLMo's and HY-V3's identity rows were silently wrong (off by 1.2e-2
and 1.2e-4; 4.1e-7 and 2.2e-8 with `key_norm=False`; full refresh exact): a random-weight model's
pre-norm keys are small enough that the norm's epsilon keeps its own keys below unit RMS, so the
projection moved them.
"""


if __name__ == "__main__":
    main()
