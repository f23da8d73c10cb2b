"""Attention for queries at scattered context columns: `column_attention`.

A batch of queries sits at known context columns (a chosen subset of a context plus a prompt
after it, in one pass); every query attends to the cached keys up to its own column:

    query [B, Hq, Nq, D], key / value [B, Hkv, Nk, D]   (q head h reads kv head h // (Hq // Hkv))
    query_columns [B, Nq] int64, ascending in each row (repeats allowed); key_columns [Nk] int64,
    strictly ascending, shared by the batch (key row j holds column key_columns[j]); columns in
    [0, 2**31); first_column [B] int64: key columns < first_column[b] are row b's left padding.

    visible(b, i, j) = first_column[b] <= key_columns[j] <= query_columns[b, i]
                       and (window is None or query_columns[b, i] - key_columns[j] < window)
                       and (chunk is None or the two columns share a chunk: (column -
                            first_column[b]) // chunk equal, Llama 4's chunked attention)
    logits = scale * q.k, then softcap * tanh(logits / softcap) if softcap is given
    out [B, Nq, Hq, D] (transformers' attention-output layout), query's dtype: the softmax over
    the visible keys of the values, beside one more logit sinks[h] per q head if sinks are given
    (GPT-OSS's attention sinks: a logit with no value, it only takes its share of the softmax);
    a query that sees no key gets zeros (never NaN).

Triton (CUDA): FlashAttention-2 online softmax, float32 accumulation (float32 operands as
3xTF32). A program takes a block of consecutive queries of one (batch row, q head); their columns
ascend, so the block's first and last column bound the keys any of them sees: a 32-way search over
key_columns on the device (no host sync: CUDA-graph capturable) finds that range and the part every
query sees; only key blocks inside it are visited, masked element-wise only at its edges. No
[Nq, Nk] tensor exists. Launch configurations are timed once per shape bucket on the first CUDA
call (warm up outside graph capture). Head dims 16..256 (padded to a power of two inside).
Few queries over many keys (a prompt over a long context: fewer programs than multiprocessors)
split each block's keys into shares, one program each, whose partial softmaxes (running max,
sum, unnormalised output; float32) merge exactly: flash-decoding (`attention_launch`).

Reference (PyTorch, every device): `reference.attention_reference`, sdpa per block of queries over
only the keys the block can see (memory: block x visible keys, never all queries x all keys).

`column_attention` checks arguments and dispatches (Triton on CUDA, reference elsewhere;
`backend=` or BRIDGECACHE_KERNELS overrides) and is registered as the torch operator
bridgecache::column_attention, so torch.compile traces it.

Knows nothing about models, caches, rotary embeddings or how columns were chosen: callers pass
keys already rotated, columns already computed, and read the output in their own layout.
"""

from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import is_fake

from ._dispatch import LazyKernel, device_of, interpreting, next_pow2, resolve_backend, sm_count
from .attention_launch import SEARCH_K, configs, merge_shares, prune, search_steps, split_config, split_count
from .checks import FLOATS, expect, last_contiguous
from .reference import attention_reference

tl = None  # triton.language, bound when the kernel is first compiled (see _dispatch.LazyKernel)

__all__ = ["attention_reference", "column_attention", "launch_attention"]


# ----------------------------------------------------------------------------------------------
# Triton kernel


def _lower_bounds(cols_ptr, n, targets, iters, K: tl.constexpr):
    """For each target value t (int64 [R]): the first index i in [0, n] with cols[i] >= t (cols
    ascending). Each step probes K evenly spaced entries of every interval, one vector load for
    all of them, and keeps the gap holding the answer: the width shrinks by K + 1 per step."""
    lo = tl.zeros_like(targets)
    hi = lo + n
    ks = tl.arange(0, K).to(tl.int64) + 1
    for _ in range(iters):
        probe = lo[:, None] + (hi - lo)[:, None] * ks[None, :] // (K + 1)
        inside = probe < hi[:, None]
        below = inside & (tl.load(cols_ptr + probe, mask=inside, other=0) < targets[:, None])
        new_lo = tl.max(tl.where(below, probe + 1, lo[:, None]), axis=1)
        hi = tl.min(tl.where(below, hi[:, None], probe), axis=1)
        lo = new_lo
    return lo


def _first_visible(c, first, window, chunk, HAS_WINDOW: tl.constexpr, HAS_CHUNK: tl.constexpr):
    """The first key column a query at column(s) `c` sees: its row's first column, raised by the
    window and by the start of its chunk (chunks counted from the row's first column)."""
    low = tl.zeros_like(c) + first
    if HAS_WINDOW:
        low = tl.maximum(low, c - window + 1)
    if HAS_CHUNK:
        low = tl.maximum(low, first + tl.maximum(c - first, 0) // chunk * chunk)
    return low


def _attend_block(
    acc, m_i, l_i, q, qc, q_low, k_base, v_base, k_n, v_n, kc_ptr, n_k, start_n,
    offs_d, d_mask, qk_mul, cap_mul,
    D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, MASK: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr, FP32: tl.constexpr, INTERPRET: tl.constexpr,
):  # fmt: skip
    """One online-softmax step over keys [start_n, start_n + BLOCK_N). MASK: the block is at the
    edge of the query block's key range, so visibility (q_low <= key column <= qc) is checked per
    element; otherwise every query of the block sees every key of it (and the keys exist)."""
    offs_n = start_n + tl.arange(0, BLOCK_N)
    k_ptrs = k_base + offs_n[:, None] * k_n + offs_d[None, :]
    v_ptrs = v_base + offs_n[:, None] * v_n + offs_d[None, :]
    if MASK:
        n_mask = offs_n < n_k
        k = tl.load(k_ptrs, mask=n_mask[:, None] & d_mask[None, :], other=0.0)
        v = tl.load(v_ptrs, mask=n_mask[:, None] & d_mask[None, :], other=0.0)
    elif BLOCK_D != D:
        k = tl.load(k_ptrs, mask=d_mask[None, :], other=0.0)
        v = tl.load(v_ptrs, mask=d_mask[None, :], other=0.0)
    else:
        k = tl.load(k_ptrs)
        v = tl.load(v_ptrs)
    if INTERPRET:  # the interpreter's bf16 arithmetic is wrong: compute on float32 copies
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    s = tl.dot(q, tl.trans(k), input_precision="tf32x3") if FP32 else tl.dot(q, tl.trans(k))
    s = s * qk_mul
    if HAS_SOFTCAP:  # cap * tanh(x), tanh(x) = 2 sigmoid(2x) - 1; cap_mul = cap * log2(e)
        s = cap_mul * (2.0 * tl.sigmoid(2.0 * s) - 1.0)
    if MASK:
        kc = tl.load(kc_ptr + offs_n, mask=n_mask, other=0).to(tl.int32)
        seen = n_mask[None, :] & (kc[None, :] <= qc[:, None]) & (kc[None, :] >= q_low[:, None])
        s = tl.where(seen, s, float("-inf"))
    # s is in log2 units: softmax by exp2
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that has seen nothing yet
    p = tl.exp2(s - m_use[:, None])
    alpha = tl.exp2(m_i - m_use)
    l_i = l_i * alpha + tl.sum(p, axis=1)
    pv = tl.dot(p, v, input_precision="tf32x3") if FP32 else tl.dot(p.to(v.dtype), v)
    acc = acc * alpha[:, None] + pv
    return acc, m_new, l_i


def _attention_kernel(
    q_ptr, q_b, q_h, q_m,
    k_ptr, k_b, k_h, k_n,
    v_ptr, v_b, v_h, v_n,
    qc_ptr, qc_b, qc_m,
    kc_ptr, first_ptr, sink_ptr,
    o_ptr, o_b, o_m, o_h,
    part_ptr, stat_ptr, n_split,
    n_q, n_k, heads, group, search_iters, qk_mul, cap_mul, window, chunk, N_Q_KEY, N_K_KEY,
    D: tl.constexpr, BLOCK_D: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_CHUNK: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr, HAS_SINKS: tl.constexpr, FP32: tl.constexpr, OUT_BF16: tl.constexpr,
    INTERPRET: tl.constexpr, SEARCH_K: tl.constexpr,
    SPLIT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    # axis 0 (fastest): (batch row, q head), so the heads sharing a kv head run side by side;
    # axis 1: query block, the last (latest columns: most keys) first, so the longest run first;
    # axis 2 (SPLIT): a share of the block's keys, its partial softmax written for `merge_shares`
    n_mb = tl.cdiv(n_q, BLOCK_M)
    m0 = (n_mb - 1 - tl.program_id(1)) * BLOCK_M
    b = (tl.program_id(0) // heads).to(tl.int64)
    h = tl.program_id(0) % heads
    kvh = (h // group).to(tl.int64)
    h = h.to(tl.int64)
    offs_m = m0 + tl.arange(0, BLOCK_M)
    m_mask = offs_m < n_q
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < D

    qc_row = qc_ptr + b * qc_b
    # columns as int32 in the [queries, keys] comparisons (fewer registers); -1: a padding row sees nothing
    qc = tl.load(qc_row + offs_m * qc_m, mask=m_mask, other=-1).to(tl.int32)
    c_min = tl.load(qc_row + m0 * qc_m)
    c_max = tl.load(qc_row + (tl.minimum(m0 + BLOCK_M, n_q) - 1) * qc_m)
    first = tl.load(first_ptr + b)

    # Key-index bounds, one search for all four: [lo, hi) holds every key a query of the block
    # sees, [full_lo, full_hi) the keys all of them see.
    r = tl.arange(0, 4)
    c = tl.where(r % 2 == 0, c_min, c_max)
    low = _first_visible(c, first, window, chunk, HAS_WINDOW, HAS_CHUNK)  # ascends with c
    bounds = _lower_bounds(kc_ptr, n_k, tl.where(r < 2, low, c + 1), search_iters, SEARCH_K)
    bounds = bounds.to(tl.int32)
    lo = tl.sum(tl.where(r == 0, bounds, 0), axis=0)
    full_lo = tl.sum(tl.where(r == 1, bounds, 0), axis=0)
    full_hi = tl.sum(tl.where(r == 2, bounds, 0), axis=0)
    hi = tl.maximum(tl.sum(tl.where(r == 3, bounds, 0), axis=0), lo)
    # Key blocks aligned to BLOCK_N: masked [start, u0), unmasked [u0, u1), masked [u1, hi).
    start = lo // BLOCK_N * BLOCK_N
    u0 = (full_lo + BLOCK_N - 1) // BLOCK_N * BLOCK_N
    u1 = full_hi // BLOCK_N * BLOCK_N
    none_full = u1 <= u0
    u0 = tl.where(none_full, start, u0)
    u1 = tl.where(none_full, start, u1)
    end = hi
    if SPLIT:  # this program's share of the key blocks: [start, end), aligned to BLOCK_N
        share = tl.cdiv(tl.cdiv(hi - start, BLOCK_N), n_split) * BLOCK_N
        start = start + tl.program_id(2) * share
        end = tl.minimum(start + share, hi)

    q_ptrs = q_ptr + b * q_b + h * q_h + offs_m[:, None] * q_m + offs_d[None, :]
    q = tl.load(q_ptrs, mask=m_mask[:, None] & d_mask[None, :], other=0.0)
    if INTERPRET:
        q = q.to(tl.float32)
    k_base = k_ptr + b * k_b + kvh * k_h
    v_base = v_ptr + b * v_b + kvh * v_h
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    q_low = _first_visible(qc, first.to(tl.int32), window, chunk, HAS_WINDOW, HAS_CHUNK)
    for start_n in range(start, tl.minimum(u0, end), BLOCK_N):
        acc, m_i, l_i = _attend_block(
            acc, m_i, l_i, q, qc, q_low, k_base, v_base, k_n, v_n, kc_ptr, n_k, start_n,
            offs_d, d_mask, qk_mul, cap_mul, D, BLOCK_D, BLOCK_N, True, HAS_SOFTCAP, FP32,
            INTERPRET,
        )  # fmt: skip
    for start_n in range(tl.maximum(u0, start), tl.minimum(u1, end), BLOCK_N):
        acc, m_i, l_i = _attend_block(
            acc, m_i, l_i, q, qc, q_low, k_base, v_base, k_n, v_n, kc_ptr, n_k, start_n,
            offs_d, d_mask, qk_mul, cap_mul, D, BLOCK_D, BLOCK_N, False, HAS_SOFTCAP, FP32,
            INTERPRET,
        )  # fmt: skip
    for start_n in range(tl.maximum(u1, start), end, BLOCK_N):
        acc, m_i, l_i = _attend_block(
            acc, m_i, l_i, q, qc, q_low, k_base, v_base, k_n, v_n, kc_ptr, n_k, start_n,
            offs_d, d_mask, qk_mul, cap_mul, D, BLOCK_D, BLOCK_N, True, HAS_SOFTCAP, FP32,
            INTERPRET,
        )  # fmt: skip

    if SPLIT:  # unnormalised: [split, batch x q heads, queries, BLOCK_D] and (max, sum) per query
        row = (tl.program_id(2) * tl.num_programs(0) + tl.program_id(0)).to(tl.int64) * n_q + offs_m
        tl.store(part_ptr + row[:, None] * BLOCK_D + offs_d[None, :], acc, mask=m_mask[:, None])
        tl.store(stat_ptr + row * 2, m_i, mask=m_mask)
        tl.store(stat_ptr + row * 2 + 1, l_i, mask=m_mask)
    else:
        if HAS_SINKS:  # the sink's share of the softmax (log2 units, as s): only the denominator grows
            sink = tl.load(sink_ptr + h).to(tl.float32) * 1.4426950408889634
            l_i = l_i + tl.exp2(sink - tl.where(m_i == float("-inf"), sink, m_i))
        o = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]  # a row that saw nothing: acc = 0
        if OUT_BF16 and INTERPRET:
            # round to nearest even by hand: Triton's interpreter truncates in .to(bfloat16)
            bits = o.to(tl.uint32, bitcast=True)
            o = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
        o_ptrs = o_ptr + b * o_b + offs_m[:, None] * o_m + h * o_h + offs_d[None, :]
        tl.store(o_ptrs, o.to(o_ptr.dtype.element_ty), mask=m_mask[:, None] & d_mask[None, :])


_KERNEL = LazyKernel(
    _attention_kernel, configs,
    key=["N_Q_KEY", "N_K_KEY", "BLOCK_D", "HAS_WINDOW", "HAS_CHUNK", "HAS_SOFTCAP", "HAS_SINKS", "FP32",
         "OUT_BF16"],
    prune=prune, helpers=(_lower_bounds, _first_visible, _attend_block),
    # query and key counts change per call: one compiled variant for all of them
    do_not_specialize=["n_q", "n_k", "search_iters", "window", "chunk"],
)  # fmt: skip

# Interpreter: small blocks, so tests cross block edges on both axes and reach unmasked blocks.
_INTERPRET_CONFIG = {"BLOCK_M": 16, "BLOCK_N": 16}
_LOG2E = 1.4426950408889634


def launch_attention(
    query, key, value, query_columns, key_columns, first_column, scale, window, softcap, out, splits=None,
    chunk=None, sinks=None,
):  # fmt: skip
    """Run the Triton kernel into `out` [B, Nq, Hq, D] (every element written); arguments as in
    `column_attention`, all last axes contiguous. splits: key shares per query block (None:
    `split_count` on CUDA, 1 in the interpreter; > 1: partial softmaxes merged by `merge_shares`)."""
    bsz, hq, n_q, dim = query.shape
    n_k = key.shape[2]
    interp = query.device.type != "cuda" or interpreting()
    block_d = max(16, next_pow2(dim))
    fp32 = query.dtype == torch.float32
    if splits is None:
        sms = 0 if interp else sm_count(query.device)
        splits = 1 if interp else split_count(bsz * hq, n_q, n_k, sms)
    part = stats = out  # partial sums and (max, sum) per share: only a split launch writes them
    if splits > 1:
        part = torch.empty(splits, bsz * hq, n_q, block_d, dtype=torch.float32, device=query.device)
        stats = torch.empty(splits, bsz * hq, n_q, 2, dtype=torch.float32, device=query.device)
    if softcap is None:
        qk_mul, cap_mul = scale * _LOG2E, 1.0
    else:
        qk_mul, cap_mul = scale / softcap, softcap * _LOG2E
    args = (
        query, *query.stride()[:3],
        key, *key.stride()[:3],
        value, *value.stride()[:3],
        query_columns, *query_columns.stride(),
        key_columns, first_column, first_column if sinks is None else sinks,
        out, *out.stride()[:3],
        part, stats, splits,
        n_q, n_k, hq, hq // key.shape[1], search_steps(n_k), qk_mul, cap_mul, window or 0, chunk or 1,
        next_pow2(n_q), next_pow2(n_k),
    )  # fmt: skip
    meta = dict(
        D=dim, BLOCK_D=block_d, HAS_WINDOW=window is not None, HAS_CHUNK=chunk is not None,
        HAS_SOFTCAP=softcap is not None, HAS_SINKS=sinks is not None, FP32=fp32,
        OUT_BF16=out.dtype == torch.bfloat16, INTERPRET=interp, SEARCH_K=SEARCH_K,
        SPLIT=splits > 1,
    )  # fmt: skip

    def grid(cfg):
        return (bsz * hq, -(-n_q // cfg["BLOCK_M"]), splits)

    with device_of(query):
        if splits > 1:  # a fixed launch: one kind of work (attention_launch.split_config)
            config = dict(_INTERPRET_CONFIG) if interp else split_config(n_q, block_d, fp32)
            _KERNEL[grid(config)](*args, **meta, **config)
            merge_shares(part, stats, out, sinks)
        elif interp:
            _KERNEL[grid(_INTERPRET_CONFIG)](*args, **meta, **_INTERPRET_CONFIG)
        else:
            bucket = (query.device, query.dtype, next_pow2(n_q), next_pow2(n_k), *meta.values())
            config = _RESOLVED.get(bucket)
            if config is None:  # the autotuner times the listed configurations once per bucket
                tuner = _KERNEL.autotuned
                tuner[grid](*args, **meta)
                best = tuner.best_config
                _RESOLVED[bucket] = dict(best.kwargs, num_warps=best.num_warps, num_stages=best.num_stages)
            else:
                _KERNEL[grid(config)](*args, **meta, **config)


# Launch options per shape bucket, the autotuner's choice (state of the launcher, read by no one else).
_RESOLVED: dict[tuple, dict] = {}


# ----------------------------------------------------------------------------------------------
# The operator: torch.library registration and dispatch

_SCHEMA = (
    "(Tensor query, Tensor key, Tensor value, Tensor query_columns, Tensor key_columns, "
    "Tensor first_column, float scale, int? window, float? softcap, int? chunk, Tensor? sinks, str backend, "
    "Tensor(a!) out) -> ()"
)


@torch.library.custom_op("bridgecache::column_attention", mutates_args=("out",), schema=_SCHEMA)
def _column_attention_op(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, query_columns: torch.Tensor,
    key_columns: torch.Tensor, first_column: torch.Tensor, scale: float, window: int | None,
    softcap: float | None, chunk: int | None, sinks: torch.Tensor | None, backend: str, out: torch.Tensor,
) -> None:  # fmt: skip
    _run_attention(query, key, value, query_columns, key_columns, first_column, scale, window, softcap,
                   chunk, sinks, backend, out)  # fmt: skip


def _run_attention(query, key, value, query_columns, key_columns, first_column, scale, window, softcap,
                   chunk, sinks, backend, out) -> None:  # fmt: skip
    """The operator's body; eager callers run it directly (no dispatcher on the hot path)."""
    run = attention_reference if backend == "torch" else launch_attention
    run(query, key, value, query_columns, key_columns, first_column, scale, window, softcap, out,
        chunk=chunk, sinks=sinks)  # fmt: skip


@_column_attention_op.register_fake
def _(query, key, value, query_columns, key_columns, first_column, scale, window, softcap, chunk, sinks,
      backend, out):  # fmt: skip
    return None


def column_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    query_columns: torch.Tensor,
    key_columns: torch.Tensor,
    first_column: torch.Tensor,
    *,
    scale: float,
    window: int | None = None,
    softcap: float | None = None,
    chunk: int | None = None,
    sinks: torch.Tensor | None = None,
    backend: str | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of queries at given context columns to the keys up to each one's column.

    Args:
        query: [B, Hq, Nq, D] float32/bfloat16/float16, any strides (last axis made contiguous).
        key, value: [B, Hkv, Nk, D], query's dtype; Hq % Hkv == 0 (q head h reads kv head
            h // (Hq // Hkv)).
        query_columns: [B, Nq] int64, ascending within each row (repeats allowed), >= 0.
        key_columns: [Nk] int64, strictly ascending, >= 0: key row j holds column key_columns[j].
        first_column: [B] int64: key columns below first_column[b] are left padding of row b.
        scale: multiplies q.k (usually D ** -0.5).
        window: a key is visible only if query column - key column < window (transformers'
            sliding window); None: no window.
        softcap: logits become softcap * tanh(logits / softcap); None: uncapped.
        chunk: a key is visible only in its query's chunk of `chunk` columns, counted from the
            row's first column (transformers' chunked attention, Llama 4); None: no chunks.
        sinks: [Hq] float32, one more logit per q head in the softmax, with no value (GPT-OSS's
            attention sinks); None: none.
        backend: "triton" | "torch" | None (see bridgecache.kernels._dispatch.resolve_backend).
        out: optional [B, Nq, Hq, D] tensor of query's dtype (last axis contiguous) to write.
    Returns:
        [B, Nq, Hq, D] in query's dtype: per query and head, the softmax over its visible keys of
        the values (float32 accumulation, the sink's share left out); zeros for a query that
        sees no key.
    The orderings of the columns are the caller's promise; they are not checked (a check would
    synchronise with the device).
    """
    bsz, hq, n_q, dim = query.shape
    if key.dim() != 4 or key.shape[0] != bsz or key.shape[3] != dim:
        raise ValueError(f"key: expected [{bsz}, kv_heads, keys, {dim}], got {tuple(key.shape)}")
    hkv, n_k = key.shape[1], key.shape[2]
    if hkv == 0 or hq % hkv:
        raise ValueError(f"query heads ({hq}) must be a multiple of key heads ({hkv})")
    expect(query, (bsz, hq, n_q, dim), FLOATS, "query")
    expect(value, (bsz, hkv, n_k, dim), (query.dtype,), "value")
    expect(key, (bsz, hkv, n_k, dim), (query.dtype,), "key")
    expect(query_columns, (bsz, n_q), (torch.int64,), "query_columns")
    expect(key_columns, (n_k,), (torch.int64,), "key_columns")
    expect(first_column, (bsz,), (torch.int64,), "first_column")
    if window is not None and window < 1:
        raise ValueError(f"window must be >= 1 or None, got {window}")
    if softcap is not None and softcap <= 0:
        raise ValueError(f"softcap must be > 0 or None, got {softcap}")
    if chunk is not None and chunk < 1:
        raise ValueError(f"chunk must be >= 1 or None, got {chunk}")
    if sinks is not None:
        expect(sinks, (hq,), (torch.float32,), "sinks")
    if out is None:
        out = torch.empty(bsz, n_q, hq, dim, dtype=query.dtype, device=query.device)
    expect(out, (bsz, n_q, hq, dim), (query.dtype,), "out")
    if out.stride(-1) != 1:
        raise ValueError("out's last axis must be contiguous")
    for x in (key, value, query_columns, key_columns, first_column, out, *([] if sinks is None else [sinks])):
        if x.device != query.device:
            raise ValueError(f"all tensors must be on one device; got {x.device} and {query.device}")
    if out.numel() == 0:
        return out
    if n_k == 0:
        return out.zero_()
    choice = resolve_backend(backend, query.device)
    if choice == "triton" and not 16 <= dim <= 256:
        if backend == "triton":
            raise ValueError(f"the Triton kernel takes head dims 16..256, got {dim}")
        choice = "torch"
    query, key, value = (last_contiguous(t) for t in (query, key, value))
    query_columns, key_columns = query_columns.contiguous(), key_columns.contiguous()
    # The custom op is what torch.compile / export (and fake tensors) trace; eager calls skip its dispatch.
    traced = torch.compiler.is_compiling() or is_fake(query)
    run = _column_attention_op if traced else _run_attention
    window = None if window is None else int(window)
    softcap = None if softcap is None else float(softcap)
    chunk = None if chunk is None else int(chunk)
    first_column = first_column.contiguous()
    sinks = None if sinks is None else sinks.contiguous()
    run(query, key, value, query_columns, key_columns, first_column, float(scale), window, softcap, chunk,
        sinks, choice, out)  # fmt: skip
    return out
