"""Layer support and head matching: which source (layer, head) each target head reads.

Layer support ("probe"): every (source layer, target layer) pair is scored by the held-out R^2
of a single-layer least-squares probe (all source KV heads of the layer -> all target KV heads of
the other), keys un-rotated and values, averaged over K, V and target heads; each target layer
takes its top-k source layers. The scores come from `ProbeMoments`, streamed like every other
statistic: per source layer the Gram matrix [Ls, Hs*Ds, Hs*Ds], and the cross moments of every
source layer with every target layer [Ls, Hs*Ds, Lt*Ht*Dt] (memory independent of the rows).
Layer support ("depth"): the k source layers nearest in relative depth; no statistics needed.

Head matching (CacheBridge): by index when the head counts match; otherwise each target head
reads the source head whose single-head probe (a sub-block of the same statistics) has the best
held-out R^2 for that (source layer, target layer) pair.

Knows nothing about models or tokenizers; it sees KV tensors only.
"""

from __future__ import annotations

import torch

from bridgecache.fitting.ridge import DEFAULT_LAM, r2, solve
from bridgecache.fitting.stats import SufficientStats

__all__ = [
    "ProbeMoments",
    "ProbeScores",
    "score_probes",
    "top_layers",
    "depth_layers",
    "match_heads",
    "full_inputs",
]

_F64 = torch.float64


class ProbeMoments:
    """Streaming statistics of all single-layer probes, for keys and values.

    update(src_k, src_v, tgt_k, tgt_v): per-layer lists of rows,
    src_*[l]: [n, src_heads, src_dim]; tgt_*[l]: [n, tgt_heads, tgt_dim] (keys un-rotated).
    """

    def __init__(self, ls: int, hs: int, ds: int, lt: int, ht: int, dt: int, device=None):
        self.shape = (ls, hs, ds, lt, ht, dt)
        ps, qt = hs * ds, lt * ht * dt
        z = lambda *s: torch.zeros(*s, dtype=_F64, device=device)  # noqa: E731
        self.xtx = {kind: z(ls, ps, ps) for kind in "kv"}
        self.sx = {kind: z(ls, ps) for kind in "kv"}
        self.xty = {kind: z(ls, ps, qt) for kind in "kv"}
        self.sy = {kind: z(qt) for kind in "kv"}
        self.syy = {kind: z(qt) for kind in "kv"}
        self.n = 0

    def update(self, src_k, src_v, tgt_k, tgt_v) -> None:
        n, device = src_k[0].shape[0], self.xtx["k"].device
        self.n += n
        for kind, src, tgt in (("k", src_k, tgt_k), ("v", src_v, tgt_v)):
            x = torch.stack([s.reshape(n, -1).to(device) for s in src]).to(_F64)  # [Ls, n, ps]
            y = torch.cat([t.reshape(n, -1).to(device) for t in tgt], dim=1).to(_F64)  # [n, Lt*Ht*Dt]
            self.xtx[kind] += x.transpose(1, 2) @ x
            self.sx[kind] += x.sum(1)
            self.xty[kind] += x.transpose(1, 2) @ y
            self.sy[kind] += y.sum(0)
            self.syy[kind] += (y * y).sum(0)

    def moments(self, kind: str, layer: int, head: int | None = None) -> SufficientStats:
        """Shared statistics of source `layer` (one `head` of it, or all) -> every target head.

        Output heads are the Lt * Ht target heads in (target layer, target head) order.
        """
        ls, hs, ds, lt, ht, dt = self.shape
        cols = slice(None) if head is None else slice(head * ds, (head + 1) * ds)
        xtx = self.xtx[kind][layer][cols, cols]
        xty = self.xty[kind][layer][cols]  # [p, Lt*Ht*Dt]
        p = xtx.shape[0]
        return SufficientStats(
            xtx=xtx.unsqueeze(0),
            xty=xty.reshape(p, lt * ht, dt).permute(1, 0, 2),
            sum_x=self.sx[kind][layer][cols].unsqueeze(0),
            sum_y=self.sy[kind].reshape(lt * ht, dt),
            sum_yy=self.syy[kind].reshape(lt * ht, dt),
            sum_w=torch.full((1,), float(self.n), dtype=_F64, device=xtx.device),
        )


class ProbeScores:
    """Held-out probe R^2.

    layer: [Ls, Lt] mean over K, V and target heads of the single-layer probe's R^2.
    head: [Ls, Hs, Lt, Ht] mean over K and V of the single-head probe's R^2.
    """

    def __init__(self, layer: torch.Tensor, head: torch.Tensor):
        self.layer = layer
        self.head = head


def score_probes(train: ProbeMoments, heldout: ProbeMoments, lam: float = DEFAULT_LAM) -> ProbeScores:
    """Fit every probe on `train` statistics and score it on `heldout` statistics."""
    ls, hs, ds, lt, ht, dt = train.shape
    layer = torch.zeros(ls, lt, dtype=_F64)
    head = torch.zeros(ls, hs, lt, ht, dtype=_F64)
    for kind in "kv":
        for s in range(ls):
            w, b = solve(train.moments(kind, s), lam)  # one Cholesky for every target layer
            per_head, _ = r2(w, b, heldout.moments(kind, s))
            layer[s] += per_head.reshape(lt, ht).mean(-1).cpu() / 2
            if hs == 1:
                head[s, 0] += per_head.reshape(lt, ht).cpu() / 2
                continue
            for h in range(hs):
                w, b = solve(train.moments(kind, s, h), lam)
                per_head, _ = r2(w, b, heldout.moments(kind, s, h))
                head[s, h] += per_head.reshape(lt, ht).cpu() / 2
    return ProbeScores(layer, head)


def top_layers(scores: torch.Tensor, k: int) -> list[list[int]]:
    """Per target layer, its k best-scoring source layers (ascending). scores: [Ls, Lt]."""
    k = min(k, scores.shape[0])
    return [sorted(scores[:, t].topk(k).indices.tolist()) for t in range(scores.shape[1])]


def depth_layers(num_source: int, num_target: int, k: int) -> list[list[int]]:
    """Per target layer, the k source layers nearest in relative depth (ascending)."""
    k = min(k, num_source)
    out = []
    for t in range(num_target):
        depth = t / max(num_target - 1, 1) * (num_source - 1)
        order = sorted(range(num_source), key=lambda s: (abs(s - depth), s))
        out.append(sorted(order[:k]))
    return out


def match_heads(
    layers: list[list[int]], num_source_heads: int, num_target_heads: int, head_scores: torch.Tensor | None
) -> list[torch.Tensor]:
    """Head-local inputs per target layer: int64 [tgt_heads, k, 2] of (source layer, source head).

    Same head count: head h reads head h. Otherwise head h reads, in each supporting source layer,
    the source head with the best single-head probe score (head_scores [Ls, Hs, Lt, Ht]).
    """
    out = []
    for t, sources in enumerate(layers):
        inputs = torch.zeros(num_target_heads, len(sources), 2, dtype=torch.long)
        for j, s in enumerate(sources):
            inputs[:, j, 0] = s
            if num_source_heads == num_target_heads:
                inputs[:, j, 1] = torch.arange(num_target_heads)
            elif head_scores is None:
                raise ValueError(
                    f"{num_source_heads} source heads vs {num_target_heads} target heads: head matching "
                    "needs probe statistics"
                )
            else:
                inputs[:, j, 1] = head_scores[s, :, t, :].argmax(0)
        out.append(inputs)
    return out


def full_inputs(layers: list[list[int]], num_source_heads: int, num_target_heads: int) -> list[torch.Tensor]:
    """Full-head inputs per target layer: every head reads every head of its k source layers."""
    out = []
    for sources in layers:
        slots = torch.tensor([(s, h) for s in sources for h in range(num_source_heads)], dtype=torch.long)
        out.append(slots.unsqueeze(0).expand(num_target_heads, -1, -1).contiguous())
    return out
