"""Attention-aligned token weights from the TARGET model's own attention (CacheBridge).

At up to 32 log-spaced prefix boundaries u (query rows u = prefix length - 1), with the target's
attention a_ui of boundary query u on key i, output o_u = sum_i a_ui v_i and query q_u:
    value weight  r^V_i = sum_u a_ui^2
    key weight    r^K_i = sum_u a_ui^2 ||v_i - o_u||^2 ||q_u||^2 s^2     (s = attention scaling)
summed over the query heads that share KV head h. ||d o_u / d k_i||_F^2 = a_ui^2 ||v_i - o_u||^2
||q_u||^2 s^2, so r^K is the squared sensitivity of the outputs to key i (s^2 = 1/d for the usual
1/sqrt(d) scaling). Only the boundary query rows are ever formed: [batch, q_heads, rows, tokens],
never the [tokens, tokens] attention matrix.

Queries come from forward pre-hooks on the attention modules, which recompute q for the boundary
rows from the module's own q_proj (or Phi-3's fused qkv_proj, GPT-NeoX's query_key_value), q_norm
(where present, per head or over the whole projection) and the rotary tables the model passes in
(`position_embeddings`, rotated in the model's RotaryLayout; none on a layer without RoPE), then
Llama 4's qk_norm (which its RoPE layers apply after the rotation); keys
and values are the captured cache. Causal masking and logit
soft-capping follow the module's attributes; the sliding window is the cache layout's
(`bridgecache.models.layout.layer_window`); GPT-OSS's sink logits take their share of each
softmax (`softmax_with_sinks`).

Knows the attention layout of transformers' Llama-style modules (q_proj, qkv_proj or
query_key_value, optional q_norm, position_embeddings, scaling, num_key_value_groups); nothing
about bridges or tokenizers.
"""

from __future__ import annotations

import math

import torch

from bridgecache.kv.rope import RopeTables, cos_sin_of, rotate
from bridgecache.models.code import QUERY_PROJECTIONS
from bridgecache.models.layout import (
    layer_chunk,
    layer_sinks,
    layer_window,
    query_temperature,
    rope_layers,
    rotary_module,
)

__all__ = ["boundary_rows", "QueryRecorder", "token_weights", "attention_modules", "softmax_with_sinks"]


def softmax_with_sinks(logits: torch.Tensor, sinks: torch.Tensor | None) -> torch.Tensor:
    """Softmax over the last axis of `logits` [..., heads..., rows, keys] beside one more logit per
    head (`sinks`, shaped as the head axes before rows: GPT-OSS's sinks, a column with no value),
    that column dropped; None: the plain softmax."""
    if sinks is None:
        return logits.softmax(-1)
    column = sinks.to(logits)[..., None, None].expand(*logits.shape[:-1], 1)
    return torch.cat([logits, column], dim=-1).softmax(-1)[..., :-1]


def boundary_rows(tokens: int, count: int = 32, first: int = 1) -> torch.Tensor:
    """Query rows of up to `count` log-spaced prefix lengths in [first + 1, tokens]: int64 [rows]."""
    start = min(first + 1, tokens)
    lengths = torch.logspace(math.log10(start), math.log10(tokens), count, dtype=torch.float64)
    return torch.unique(lengths.round().long().clamp(start, tokens)) - 1


def attention_modules(model) -> list[torch.nn.Module]:
    """The self-attention modules of a transformers decoder, ordered by layer index."""
    found = [m for m in model.modules() if _projects_queries(m) and hasattr(m, "layer_idx")]
    if not found:
        raise ValueError(
            f"{type(model).__name__} has no attention modules with q_proj (or qkv_proj) and layer_idx"
        )
    return sorted(found, key=lambda m: m.layer_idx)


def _projects_queries(module) -> bool:
    return any(hasattr(module, name) for name in QUERY_PROJECTIONS)


def head_dim(module) -> int:
    """The head dim of an attention module (GPT-NeoX names it `head_size`)."""
    return getattr(module, "head_dim", None) or module.head_size


def _project_queries(module, hidden: torch.Tensor, heads: int) -> torch.Tensor:
    """[batch, rows, q_heads * head_dim]: the queries of `hidden` (`heads` query heads). Phi-3 fuses
    q, k, v in `qkv_proj`, queries first; `query_key_value` holds per KV head its g = heads / kv
    query heads, then its key and its value ([q_1 .. q_g | k | v]: GPT-NeoX g = 1, Falcon's
    multi-query kv = 1, Falcon's grouped layout), kv read from the projection's width."""
    if hasattr(module, "q_proj"):
        return module.q_proj(hidden)
    d = head_dim(module)
    if hasattr(module, "query_key_value"):
        qkv = module.query_key_value(hidden)
        kv = (qkv.shape[-1] // d - heads) // 2  # width = kv * (g + 2) * d = (heads + 2 kv) * d
        grouped = qkv.view(*hidden.shape[:-1], kv, heads // kv + 2, d)
        return grouped[..., : heads // kv, :].reshape(*hidden.shape[:-1], heads * d)
    if hasattr(module, "q_gate_proj"):
        gated = module.q_gate_proj(hidden).view(*hidden.shape[:-1], heads, 2 * d)
        return gated[..., :d].reshape(*hidden.shape[:-1], heads * d)
    return module.qkv_proj(hidden)[..., : heads * d]


class QueryRecorder:
    """Context manager keeping each layer's boundary queries during one forward pass.

    queries[l]: [batch, q_heads, rows, head_dim] float32 (after q-norm and RoPE).
    """

    def __init__(self, model, rows: torch.Tensor):
        self.modules = attention_modules(model)
        self.tables = RopeTables.from_model(model) if rotary_module(model) is not None else None
        config = model.config.get_text_config()
        self.heads, self.rope = config.num_attention_heads, rope_layers(config)
        self.rows = rows
        self.queries: dict[int, torch.Tensor] = {}
        self._handles = []

    def __enter__(self) -> QueryRecorder:
        for module in self.modules:
            self._handles.append(module.register_forward_pre_hook(self._hook, with_kwargs=True))
        return self

    def _rows_on(self, device: torch.device) -> torch.Tensor:
        """The rows on `device`, copied once: a host-to-device copy per layer would wait for the
        GPU to finish every layer before the next could be queued."""
        if self.rows.device != device:
            self.rows = self.rows.to(device)
        return self.rows

    def __exit__(self, *exc) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def _hook(self, module, args, kwargs):
        hidden = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
        tables = kwargs["position_embeddings"] if "position_embeddings" in kwargs else args[1]
        rows = self._rows_on(hidden.device)
        h = hidden[:, rows]  # q_proj is per token: project only the boundary rows
        d = head_dim(module)
        q = _project_queries(module, h, self.heads)
        norm = getattr(module, "q_norm", None) or getattr(module, "q_layernorm", None)  # StableLM's name
        weight = None if norm is None else getattr(norm, "weight", None)
        whole = weight is not None and weight.shape[-1] != d  # OLMo 2: all heads at once
        if whole:
            q = norm(q)
        q = q.view(h.shape[0], h.shape[1], -1, d)
        if weight is not None and weight.dim() == 2:  # Cohere's: one norm over [heads, head_dim]
            q = norm(q)
        q = q.transpose(1, 2)
        if norm is not None and not whole and (weight is None or weight.dim() == 1):
            q = norm(q)
        if self.rope[module.layer_idx]:  # SmolLM3's no-RoPE layers: queries as they are
            cos, sin = cos_sin_of(tables)
            cos, sin = self.tables.canonical(cos[:, rows].float(), sin[:, rows].float())
            q = rotate(q.float(), cos, sin, self.tables.layout)
            after = getattr(module, "qk_norm", None)  # Llama 4's: after RoPE, on its RoPE layers
            if after is not None:
                q = after(q)
        else:
            q = q.float()
            temperature = query_temperature(module, rows)  # Llama 4's NoPE layers: [rows]
            if temperature is not None:
                q = q * temperature[:, None]
        self.queries[module.layer_idx] = q


@torch.no_grad()
def token_weights(
    queries: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    rows: torch.Tensor,
    scaling: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    chunk: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Raw key and value weights (r^K, r^V) of every token: each [batch, kv_heads, tokens] float32.

    queries: [batch, q_heads, rows, d] boundary queries; keys (post-RoPE), values:
    [batch, kv_heads, tokens, d]; rows: [rows] int64 query positions; sinks: [q_heads] sink
    logits (GPT-OSS) or None; chunk: queries see keys of their own chunk only (Llama 4) or None.
    """
    b, hq, nb, d = queries.shape
    hkv, t = keys.shape[1], keys.shape[2]
    q = queries.float().view(b, hkv, hq // hkv, nb, d)
    k, v = keys.float().unsqueeze(2), values.float().unsqueeze(2)  # [b, hkv, 1, t, d]
    logits = (q @ k.transpose(-1, -2)) * scaling  # [b, hkv, group, rows, t]
    if softcap:
        logits = torch.tanh(logits / softcap) * softcap
    u = rows.to(keys.device)[:, None]
    i = torch.arange(t, device=keys.device)[None, :]
    allowed = i <= u
    if sliding_window:
        allowed &= u - i < sliding_window
    if chunk:
        allowed &= u // chunk == i // chunk
    logits = logits.masked_fill(~allowed, float("-inf"))
    attn = softmax_with_sinks(logits, None if sinks is None else sinks.view(hkv, hq // hkv))
    out = attn @ v  # [b, hkv, group, rows, d]
    a2 = attn * attn
    r_value = a2.sum((2, 3))
    # ||v_i - o_u||^2 = ||v_i||^2 - 2 v_i.o_u + ||o_u||^2, without a [rows, t, d] tensor.
    v_norm2 = (v * v).sum(-1).unsqueeze(-2)  # [b, hkv, 1, 1, t]
    dist = v_norm2 - 2.0 * (out @ v.transpose(-1, -2)) + (out * out).sum(-1, keepdim=True)
    q_norm2 = (q * q).sum(-1, keepdim=True) * scaling * scaling
    r_key = (a2 * dist.clamp_min(0.0) * q_norm2).sum((2, 3))
    return r_key, r_value


def layer_weights(
    model, recorder: QueryRecorder, keys, values
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """(r^K, r^V) per target layer from a recorder filled by one forward pass and its cache."""
    r_keys, r_values = [], []
    for module in recorder.modules:
        layer = module.layer_idx
        r_k, r_v = token_weights(
            recorder.queries[layer],
            keys[layer],
            values[layer],
            recorder.rows,
            scaling=module.scaling,
            sliding_window=layer_window(module),
            softcap=getattr(module, "attn_logit_softcapping", None),
            sinks=layer_sinks(module),
            chunk=layer_chunk(module),
        )
        r_keys.append(r_k)
        r_values.append(r_v)
    return r_keys, r_values
