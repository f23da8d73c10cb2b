"""Trained refinement on top of a closed-form bridge (`refine_bridge`): per target layer and KV
head a low-rank residual r(x) = gelu(x A + a) B (`bridgecache.refinement`) on the inputs the
closed-form map reads, trained with Adam against the TARGET's own attention outputs.

For each calibration context the target reads the context natively once: its queries at up to
`rows_per_context` rows (`QueryRecorder`, as `heldout.attention_cosine` scores a bridge) and its
attention outputs there over its own keys and values. The source's KV goes through the
closed-form maps. At fixed queries a layer's attention output depends on that layer's keys and
values alone, so each target layer trains on its own: keys = RoPE(closed form + r_K(x)), values
= closed form + r_V(x), the recorded queries attend over [native head rows, bridged rows], and
the loss is 1 - cosine (or the relative squared error) against the native outputs. B starts at
zero: step 0 is exactly the closed form. Every `validate_every`-th context is held back, and a
layer keeps its residual only if it lowers the loss on those contexts; the others stay closed
form.

Knows models and bridges; tokenizers only to turn texts into contexts (as `heldout` does).
"""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass

import torch
from tqdm.auto import tqdm

from bridgecache.capture import capture_kv
from bridgecache.fitting.attention import QueryRecorder, attention_modules
from bridgecache.fitting.calibration import same_tokenizer
from bridgecache.fitting.heldout import _outputs, recipe_contexts
from bridgecache.keynorm import key_norm_scales, project_to_key_norm
from bridgecache.refinement import LayerRefinement
from bridgecache.rope import rotate
from bridgecache.translate import LayerPlan, closed_form_parts, layer_sources

__all__ = ["LOSSES", "refine_bridge", "strip_refinement", "train_refinement"]

LOSSES = ("cosine", "mse")


@dataclass
class _LayerData:
    """One context's tensors for one target layer (batch 1; T = translated columns).

    inputs_k, inputs_v: [1, tgt_heads or 1, T, n_in * src_dim]; base_k (un-rotated), base_v:
    [1, tgt_heads, T, tgt_dim] closed form; valid: [1, 1, T, 1]; cos, sin: [1, T, tgt_dim];
    head_k, head_v: [1, tgt_heads, P, tgt_dim] the native rows in front (post-RoPE);
    queries: [1, q_heads, R, tgt_dim]; rows: [R] query positions; columns: [P + T];
    wanted: [q_heads, R, tgt_dim] the target's own attention outputs.
    """

    inputs_k: torch.Tensor
    inputs_v: torch.Tensor
    base_k: torch.Tensor
    base_v: torch.Tensor
    valid: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor
    head_k: torch.Tensor
    head_v: torch.Tensor
    queries: torch.Tensor
    rows: torch.Tensor
    columns: torch.Tensor
    wanted: torch.Tensor


def strip_refinement(bridge):
    """A copy of `bridge` without any trained refinement (the closed form alone; tensors shared)."""
    layers = [dataclasses.replace(layer, refinement=None) for layer in bridge.layers]
    return dataclasses.replace(bridge, layers=layers, refinement={})


def refine_bridge(
    bridge,
    source,
    target,
    texts=None,
    source_tokenizer=None,
    target_tokenizer=None,
    *,
    rank: int = 32,
    steps: int = 200,
    max_texts: int = 48,
    progress: bool = True,
    **options,
):
    """A new Bridge: `bridge`'s closed-form maps plus a trained low-rank residual per layer.

    texts: strings (tokenized with both tokenizers, aligned across them with the bridge's policy),
        or (source_ids [1, S], target_ids [1, T], alignment or None) contexts; None: the training
        (not held-out) sequences of the bridge's own calibration recipe (`bridgecache.text`, split
        "calib"), so its held-out scores stay held out. At most `max_texts` are used.
    rank: hidden width of each residual; steps: Adam steps per layer.
    options: of `train_refinement` (lr, loss, batch, rows_per_context, validate_every, seed).
    `bridge` is not modified; an existing refinement is replaced (training starts from the closed form).
    """
    contexts = _contexts(bridge, texts, source_tokenizer, target_tokenizer, max_texts)
    return train_refinement(
        bridge, source, target, contexts, rank=rank, steps=steps, progress=progress, **options
    )


def train_refinement(
    bridge,
    source,
    target,
    contexts,
    *,
    rank: int = 32,
    steps: int = 200,
    lr: float = 3e-3,
    loss: str = "cosine",
    batch: int = 8,
    rows_per_context: int = 64,
    validate_every: int = 8,
    seed: int = 0,
    progress: bool = True,
):
    """`refine_bridge` on contexts: (source_ids [1, S], target_ids [1, T], alignment or None)."""
    _check_options(rank=rank, steps=steps, lr=lr, loss=loss, batch=batch, rows=rows_per_context)
    if validate_every < 2:
        raise ValueError(f"validate_every={validate_every!r}: expected an integer >= 2")
    closed = strip_refinement(bridge)
    started = time.perf_counter()
    prepared = [_prepare(closed, source, target, c, rows_per_context) for c in _bar(contexts, progress)]
    prepared = [p for p in prepared if p is not None]
    held = [p for i, p in enumerate(prepared) if (i + 1) % validate_every == 0]
    train = [p for i, p in enumerate(prepared) if (i + 1) % validate_every != 0]
    if not train or not held:
        raise ValueError(
            f"{len(prepared)} usable contexts (of {len(contexts)}): training needs at least {validate_every} "
            f"with 3 or more translated tokens (one in {validate_every} validates)"
        )
    modules = attention_modules(target)
    scales = key_norm_scales(target)  # as BridgedCache applies them (key_norm=True)
    generator = torch.Generator().manual_seed(seed)
    layers, before, after, kept = [], [], [], []
    for i, module in enumerate(_bar(modules, progress, "refine layers")):
        scale = None if scales is None or scales[i] is None else scales[i].float().cpu()
        train_i, held_i = [p[i] for p in train], [p[i] for p in held]
        trainable = _Trainable(train_i, closed.target.num_kv_heads, rank, generator)
        loss_before = _mean_loss(held_i, trainable.refinement(), module, scale, loss)
        _fit(trainable, train_i, module, scale, loss, steps=steps, lr=lr, batch=batch, generator=generator)
        refinement = trainable.refinement()
        loss_after = _mean_loss(held_i, refinement, module, scale, loss)
        keep = loss_after < loss_before
        layers.append(dataclasses.replace(closed.layers[i], refinement=refinement if keep else None))
        before.append(round(loss_before, 5))
        after.append(round(loss_after, 5))
        kept.append(keep)
    description = {
        "activation": "gelu",
        "loss": loss,
        "steps": steps,
        "lr": lr,
        "batch": batch,
        "rows_per_context": rows_per_context,
        "contexts": len(train),
        "validation_contexts": len(held),
        "seed": seed,
        "validation_loss_closed_form": before,
        "validation_loss_refined": after,
        "train_seconds": round(time.perf_counter() - started, 1),
    }
    refinement = description if any(kept) else {}
    calibration = dict(closed.calibration)
    refined = dataclasses.replace(closed, layers=layers, refinement=refinement, calibration=calibration)
    if any(kept):
        refined.refinement["rank"] = rank
    return refined


def _check_options(*, rank, steps, lr, loss, batch, rows) -> None:
    for name, value, low in (("rank", rank, 1), ("steps", steps, 0), ("batch", batch, 1), ("rows", rows, 1)):
        if not isinstance(value, int) or isinstance(value, bool) or value < low:
            raise ValueError(f"{name}={value!r}: expected an integer >= {low}")
    if not isinstance(lr, (int, float)) or not math.isfinite(lr) or lr <= 0:
        raise ValueError(f"lr={lr!r}: expected a finite number > 0")
    if loss not in LOSSES:
        raise ValueError(f"loss={loss!r}: expected one of {LOSSES}")


def _contexts(bridge, texts, source_tokenizer, target_tokenizer, limit: int) -> list:
    """Up to `limit` (source_ids, target_ids, alignment) triples from `texts` (see `refine_bridge`)."""
    if texts is not None and all(isinstance(t, tuple) for t in texts):
        return list(texts)[:limit]
    if source_tokenizer is None or target_tokenizer is None:
        raise ValueError("refining on texts needs source_tokenizer and target_tokenizer")
    policy = bridge.alignment_policy if bridge.alignment_policy != "identity" else None
    if texts is None:
        return recipe_contexts(bridge, source_tokenizer, target_tokenizer, heldout=False)[:limit]
    if not all(isinstance(t, str) for t in texts):
        raise ValueError("texts must be strings or (source_ids, target_ids, alignment) tuples, not a mix")
    if policy is None and not same_tokenizer(source_tokenizer, target_tokenizer):
        raise ValueError("the bridge maps one tokenization (policy 'identity'); the tokenizers differ")
    out = []
    for text in texts[:limit]:
        if policy is None:
            ids = torch.as_tensor(target_tokenizer(text)["input_ids"], dtype=torch.long)[None]
            out.append((ids, ids, None))
        else:
            import tokenalign

            alignment, source_ids, target_ids = tokenalign.align(
                text, source_tokenizer, target_tokenizer, policy=policy
            )
            as_row = lambda ids: torch.as_tensor(ids, dtype=torch.long)[None]  # noqa: E731
            out.append((as_row(source_ids), as_row(target_ids), alignment))
    return out


@torch.no_grad()
def _prepare(closed, source, target, context, rows_per_context: int) -> list[_LayerData] | None:
    """Every layer's training tensors for one context (CPU, float32); None if it is too short."""
    from bridgecache.cache import BridgedCache

    source_ids, target_ids, alignment = context
    # The decoders alone: their KV and queries are the models', without the vocabulary projection.
    source_kv = capture_kv(source, source_ids)
    cache = BridgedCache(closed, source_kv, target, target_ids, alignment=alignment)
    tr = cache.translator  # the row plan, native head rows and rope tables of this context
    first, prefix = tr.native_prefix, tr.prefix_length
    if prefix - first < 3:
        return None
    rows = torch.linspace(first + 1, prefix - 1, min(rows_per_context, prefix - first - 1))
    rows = rows.round().long().unique()
    with QueryRecorder(target, rows) as recorder:  # every column, sliding layers too
        native = capture_kv(target.get_decoder(), target_ids[:, :prefix])
    device = torch.device("cpu")
    columns = torch.arange(prefix)
    out = []
    for i, module in enumerate(recorder.modules):
        plan = LayerPlan.build(closed.layers[i], closed.source.num_kv_heads, device)
        src_k, src_v, plan_rows, src_cos, src_sin = layer_sources(
            plan, tr.source, tr.source_rope, tr.rows[:, first:]
        )
        base_k, base_v, inputs_k, inputs_v = closed_form_parts(
            plan, src_k, src_v, plan_rows, src_cos, src_sin
        )
        cos, sin = tr.target_rope.cos_sin(i, tr.target_positions[:, first:prefix])
        queries = recorder.queries[i].float().cpu()
        wanted = _outputs(queries, native.keys[i], native.values[i], rows, columns, module)
        out.append(
            _LayerData(
                inputs_k=inputs_k,
                inputs_v=inputs_v,
                base_k=base_k,
                base_v=base_v,
                valid=(plan_rows >= 0)[:, None, :, None],
                cos=cos.float().cpu(),
                sin=sin.float().cpu(),
                head_k=tr.native_keys[i][:, :, :first].float().cpu(),
                head_v=tr.native_values[i][:, :, :first].float().cpu(),
                queries=queries,
                rows=rows,
                columns=columns,
                wanted=wanted.float().cpu(),
            )
        )
    return out


class _Trainable:
    """One layer's residuals in units where training is scale-free: inputs standardised per
    feature (pre-activations start ~N(0, 1)) and outputs in units of the closed form's spread
    per head, so one learning rate fits every layer and model. `refinement()` folds the units
    into a plain LayerRefinement (the same function), differentiably."""

    def __init__(self, data: list[_LayerData], heads: int, rank: int, generator):
        self.params, self.units = {}, {}
        valid = torch.cat([d.valid[0, 0, :, 0] for d in data])
        for kind in ("key", "value"):
            inputs = torch.cat([getattr(d, f"inputs_{kind[0]}")[0].transpose(0, 1) for d in data])
            outputs = torch.cat([getattr(d, f"base_{kind[0]}")[0].transpose(0, 1) for d in data])
            x, y = inputs[valid], outputs[valid]  # [rows, heads or 1, p], [rows, heads, dim]
            width, dim = x.shape[-1], y.shape[-1]
            mean, std = x.mean(0).expand(heads, width), x.std(0).clamp_min(1e-6).expand(heads, width)
            spread = (y - y.mean(0)).pow(2).mean((0, 2)).sqrt().clamp_min(1e-6)  # [heads]
            self.units[kind] = (mean, std, spread)
            self.params[kind] = {
                "down": torch.randn(heads, width, rank, generator=generator) / math.sqrt(width),
                "bias": torch.zeros(heads, rank),
                "up": torch.zeros(heads, rank, dim),
            }

    def tensors(self) -> list[torch.Tensor]:
        return [t for kind in self.params.values() for t in kind.values()]

    def refinement(self) -> LayerRefinement:
        parts = {}
        for kind, p in self.params.items():
            mean, std, spread = self.units[kind]
            parts[f"{kind}_down"] = p["down"] / std[..., None]  # x A = ((x - mean) / std) A_n + ...
            parts[f"{kind}_down_bias"] = p["bias"] - ((mean / std)[:, None, :] @ p["down"])[:, 0]
            parts[f"{kind}_up"] = p["up"] * spread[:, None, None]
        return LayerRefinement(**parts)


def _outputs_of(d: _LayerData, refinement: LayerRefinement, module, scale) -> torch.Tensor:
    """Attention outputs [q_heads, R, tgt_dim] of the recorded queries over the refined bridged KV."""
    keys = d.base_k + refinement.residual("key", d.inputs_k) * d.valid
    if scale is not None:
        keys = project_to_key_norm(keys, scale)
    keys = torch.cat([d.head_k, rotate(keys, d.cos, d.sin)], dim=2)
    values = torch.cat([d.head_v, d.base_v + refinement.residual("value", d.inputs_v) * d.valid], dim=2)
    return _outputs(d.queries, keys, values, d.rows, d.columns, module)


def _loss(out: torch.Tensor, wanted: torch.Tensor, kind: str) -> torch.Tensor:
    if kind == "cosine":
        return 1.0 - torch.nn.functional.cosine_similarity(out, wanted, dim=-1).mean()
    return (out - wanted).pow(2).sum(-1).mean() / wanted.pow(2).sum(-1).mean().clamp_min(1e-12)


@torch.no_grad()
def _mean_loss(data, refinement, module, scale, kind) -> float:
    return float(
        sum(_loss(_outputs_of(d, refinement, module, scale), d.wanted, kind) for d in data) / len(data)
    )


def _fit(trainable: _Trainable, data, module, scale, kind, *, steps, lr, batch, generator) -> None:
    """Adam on the layer's parameters (in place); each step a random batch of the contexts."""
    tensors = trainable.tensors()
    for t in tensors:
        t.requires_grad_(True)
    optimizer = torch.optim.Adam(tensors, lr=lr)
    for _ in range(steps):
        chosen = torch.randperm(len(data), generator=generator)[:batch].tolist()
        refinement = trainable.refinement()
        total = sum(
            _loss(_outputs_of(data[j], refinement, module, scale), data[j].wanted, kind) for j in chosen
        )
        optimizer.zero_grad()
        (total / len(chosen)).backward()
        optimizer.step()
    for t in tensors:
        t.requires_grad_(False)


def _bar(items, progress: bool, desc: str = "refine: target forwards"):
    return tqdm(items, desc=desc, disable=not progress)
