"""Full-Head's shared statistics (GEMMs over distinct blocks) equal the per-layer statistics of
the reference accumulator and of the rows written out, at both GEMM precisions (bfloat16 rows:
the rows rounded, then exact), padding and chunking included, and a Full-Head fit takes them by
default. The per-head statistics of a group's layers on one stacked head axis
equal each layer's own, and a CacheBridge fit through them gives the per-layer path's maps."""

from __future__ import annotations

import pytest
import torch
from tiny_models import byte_tokenizer, tiny_model

from bridgecache.fitting import FitConfig, PairedKV, fit_bridge, fit_layer_maps
from bridgecache.fitting import gram as gram_module
from bridgecache.fitting import group as group_module
from bridgecache.fitting.core import LayerAccumulator
from bridgecache.fitting.gram import SharedGram, chunks
from bridgecache.fitting.group import GroupStatistics, shared_groups
from bridgecache.fitting.products import GEMM_PRECISIONS, Products
from bridgecache.fitting.stats import WeightedMoments
from bridgecache.fitting.support import full_inputs

HS, DS, HT, DT = 2, 8, 3, 4
SUPPORTS = {0: [0, 2], 1: [1, 2, 3], 2: [0, 2], 3: [3]}  # overlapping: blocks (0,2), (2,2), ... shared


def _batch(seed: int, batch: int = 3, tokens: int = 30, n: int = 25):
    g = torch.Generator().manual_seed(seed)
    src = [torch.randn(batch, HS, tokens, DS, generator=g, dtype=torch.float64) for _ in range(4)]
    tgt = [torch.randn(batch, HT, tokens, DT, generator=g, dtype=torch.float64) for _ in range(4)]
    src_rows = torch.stack([torch.randperm(tokens, generator=g)[:n] for _ in range(batch)])
    tgt_rows = torch.stack([torch.randperm(tokens, generator=g)[:n] for _ in range(batch)])
    src_rows[1, n - 7 :] = tgt_rows[1, n - 7 :] = -1  # a shorter sequence, padded
    return src, tgt, src_rows, tgt_rows


@pytest.mark.parametrize("precision", GEMM_PRECISIONS)
@pytest.mark.parametrize("chunk", [2**28, 4096])
def test_shared_blocks_equal_each_layers_own_statistics(monkeypatch, chunk, precision):
    monkeypatch.setattr(gram_module, "_CHUNK_BYTES", chunk)  # 4096: rows added in several chunks
    shared = SharedGram(SUPPORTS, HS, DS, HT, DT, precision=precision)
    inputs = full_inputs([SUPPORTS[t] for t in range(4)], HS, HT)
    own = [LayerAccumulator(t, inputs[t], HS, DS, DT, False, precision=precision) for t in range(4)]
    batches = [_batch(seed) for seed in range(2)]
    for src, tgt, src_rows, tgt_rows in batches:
        shared.add(src, tgt, src_rows, tgt_rows, chunks(src_rows, shared.row_bytes(HS * DS)))
        seq = PairedKV(src, src, tgt, tgt, src_rows, tgt_rows)
        for acc in own:
            acc.add(seq)
    assert len(shared.pairs) == 8 < sum(len(s) * (len(s) + 1) // 2 for s in SUPPORTS.values())
    for t, acc in enumerate(own):
        got, kernel = shared.stats(t), acc.train["k"]
        want = _brute_force(t, batches, Products(precision))
        assert float(got.sum_w) == float(kernel.sum_w) == 2 * (3 * 25 - 7)
        for name in ("xtx", "xty", "sum_x", "sum_y", "sum_yy"):
            torch.testing.assert_close(getattr(got, name), want[name], rtol=1e-12, atol=1e-10)
            torch.testing.assert_close(getattr(kernel, name), want[name], rtol=1e-12, atol=1e-10)
        if precision == "bf16-gemm":  # the rounding is seen: these rows are not bfloat16 numbers
            exact = _brute_force(t, batches, Products("tf32x3"))
            assert not torch.allclose(got.xtx, exact["xtx"], rtol=1e-6, atol=0)
            torch.testing.assert_close(got.xtx, exact["xtx"], rtol=2e-2, atol=0.5)


def _brute_force(t: int, batches, products: Products) -> dict:
    """Target layer t's moments from its materialised rows X [m, p] and Y [m, HT * DT] in
    `products`' dtype, multiplied in float64."""
    batches = [([products.rows(x).double() for x in src], [products.rows(y).double() for y in tgt], *rows)
               for src, tgt, *rows in batches]  # fmt: skip
    xs, ys = [], []
    for src, tgt, src_rows, tgt_rows in batches:
        b, i = (src_rows >= 0).nonzero(as_tuple=True)
        s, r = src_rows[b, i], tgt_rows[b, i]
        xs.append(torch.cat([src[a][b, :, s].reshape(len(b), -1) for a in SUPPORTS[t]], 1))
        ys.append(tgt[t][b, :, r].reshape(len(b), HT, DT))
    x, y = torch.cat(xs), torch.cat(ys)
    return {
        "xtx": (x.T @ x)[None],
        "xty": torch.einsum("mp,mhd->hpd", x, y),
        "sum_x": x.sum(0)[None],
        "sum_y": y.sum(0),
        "sum_yy": (y * y).sum(0),
    }


def test_full_head_fits_through_the_shared_blocks_unless_the_kernel_precision_is_asked_for():
    g = torch.Generator().manual_seed(0)
    seqs = []
    for i in range(6):
        src = [torch.randn(1, HS, 40, DS, generator=g) + 3.0 for _ in range(4)]
        noise = [0.1 * torch.randn(1, HT, 40, DT, generator=g) for _ in src]
        tgt = [s[:, :1].expand(1, HT, 40, DS)[..., :DT] * 2 - 1 + e for s, e in zip(src, noise)]
        rows = torch.arange(1, 40)
        seqs.append(PairedKV(src, src, tgt, tgt, rows, rows, heldout=i % 3 == 2))
    config = FitConfig(layers_k=2, lam=1e-4)
    maps, info = fit_layer_maps(lambda w: seqs, (4, HS, DS), (4, HT, DT), config)
    assert info["statistics"] == "shared GEMMs on bfloat16 rows, float64 totals"
    exact, exact_info = fit_layer_maps(
        lambda w: seqs, (4, HS, DS), (4, HT, DT), config.replace(stats_precision="tf32x3")
    )
    assert exact_info["statistics"] == "shared GEMMs on float64 rows, float64 totals"
    for a, b in zip(maps, exact):  # bfloat16 rows: the same maps but for the rows' rounding
        assert a.source_layers == b.source_layers
        # ~150 training rows: weights of about 2 move by ~1.5e-3, biases (offset 3 x the weights) ~2e-2
        for name, atol in (
            ("key_weight", 5e-3),
            ("key_bias", 5e-2),
            ("value_weight", 5e-3),
            ("value_bias", 5e-2),
        ):
            torch.testing.assert_close(getattr(a, name), getattr(b, name), rtol=0, atol=atol)
        assert a.r2_key == pytest.approx(b.r2_key, abs=1e-4) and a.r2_value == pytest.approx(
            b.r2_value, abs=1e-4
        )
    maps = exact
    ref, ref_info = fit_layer_maps(
        lambda w: seqs, (4, HS, DS), (4, HT, DT), config.replace(stats_precision="tf32")
    )
    assert ref_info["statistics"] == "fused kernel (tf32)"  # on the CPU: the float64 reference
    for a, b in zip(maps, ref):
        assert a.source_layers == b.source_layers
        for name in ("key_weight", "key_bias", "value_weight", "value_bias"):
            torch.testing.assert_close(getattr(a, name), getattr(b, name), rtol=1e-4, atol=1e-5)
        assert a.r2_key == pytest.approx(b.r2_key, abs=1e-6) and a.r2_key > 0.9


def test_groups_of_layers_keep_their_shared_blocks_within_the_budget():
    one = {t: SharedGram.bytes_of({t: s}, HS * DS, HT * DT) for t, s in SUPPORTS.items()}
    assert shared_groups(SUPPORTS, HS * DS, HT * DT, 4, None) == [[0, 1, 2, 3]]
    budget = 4 * max(one.values()) + 1
    groups = shared_groups(SUPPORTS, HS * DS, HT * DT, 4, budget)
    assert len(groups) > 1 and sorted(t for g in groups for t in g) == [0, 1, 2, 3]
    for group in groups:
        assert 4 * SharedGram.bytes_of({t: SUPPORTS[t] for t in group}, HS * DS, HT * DT) <= budget
    with pytest.raises(MemoryError, match=r"target layer 1's statistics need .* raise memory_budget_gb"):
        shared_groups(SUPPORTS, HS * DS, HT * DT, 4, 4 * one[0])  # layer 1 reads three layers


@pytest.mark.parametrize("precision", GEMM_PRECISIONS)
@pytest.mark.parametrize("chunk", [2**28, 4096])
def test_per_head_rows_give_the_weighted_statistics_of_their_materialised_rows(monkeypatch, chunk, precision):
    """CacheBridge's statistics at a GEMM precision (GEMMs on rows gathered once): each head's
    plain, r-weighted and held-out moments equal those of its rows written out (in bfloat16 for
    "bf16-gemm", the weighted rows rounded as well)."""
    monkeypatch.setattr(gram_module, "_CHUNK_BYTES", chunk)
    inputs = torch.tensor([[[0, 1], [2, 0]], [[3, 1], [2, 1]], [[0, 0], [3, 0]]])  # [HT, 2 slots, 2]
    acc = LayerAccumulator(1, inputs, HS, DS, DT, True, precision=precision)
    products = Products(precision)
    batches = [_batch(seed) for seed in range(3)]
    g = torch.Generator().manual_seed(9)
    weights = [[torch.rand(3, HT, 30, generator=g, dtype=torch.float64) for _ in range(4)] for _ in batches]
    for (src, tgt, src_rows, tgt_rows), r in zip(batches, weights):
        acc.add(
            PairedKV(src, src, tgt, tgt, src_rows, tgt_rows, heldout=False, key_weights=r, value_weights=r)
        )
    src, tgt, src_rows, tgt_rows = batches[0]
    acc.add(PairedKV(src, src, tgt, tgt, src_rows, tgt_rows, heldout=True))
    for h in range(HT):
        x, y, r = [], [], []
        for (src, tgt, src_rows, tgt_rows), w in zip(batches, weights):
            b, i = (src_rows >= 0).nonzero(as_tuple=True)
            s, t = src_rows[b, i], tgt_rows[b, i]
            x.append(torch.cat([src[int(a)][b, int(hd), s] for a, hd in inputs[h]], 1))
            y.append(tgt[1][b, h, t])
            r.append(w[1][b, h, t])
        x, y, r = torch.cat(x), torch.cat(y), torch.cat(r)
        xr = products.weighted(products.rows(x), r).double()  # rounded after weighting, as fitted
        x, y = products.rows(x).double(), products.rows(y).double()
        moments = acc.train["k"]
        torch.testing.assert_close(moments.plain.xtx[h], x.T @ x, rtol=1e-12, atol=1e-10)
        torch.testing.assert_close(moments.by_r.xtx[h], xr.T @ x, rtol=1e-12, atol=1e-10)
        torch.testing.assert_close(moments.by_r.xty[h], xr.T @ y, rtol=1e-12, atol=1e-10)
        torch.testing.assert_close(moments.by_r.sum_x[h], xr.sum(0), rtol=1e-12, atol=1e-10)
        torch.testing.assert_close(
            moments.by_r.sum_yy[h], (r[:, None] * y * y).sum(0), rtol=1e-12, atol=1e-10
        )
        assert float(moments.n[h]) == len(r) and float(moments.sum_r[h]) == pytest.approx(float(r.sum()))
        assert float(moments.sum_r2[h]) == pytest.approx(float((r * r).sum()))
        assert float(acc.heldout["k"].sum_w[h]) == 3 * 25 - 7


# [HT, 2 slots, 2] (source layer, source head) per target layer: matched heads differing by
# layer and head, a layer reading one source layer twice, and one whose heads all read the same
# inputs (one Gram matrix, G = 1)
MATCHED = [
    torch.tensor([[[0, 1], [2, 0]], [[3, 1], [2, 1]], [[0, 0], [3, 0]]]),
    torch.tensor([[[1, 0], [3, 1]]] * HT),
    torch.tensor([[[2, 1], [2, 0]], [[2, 0], [0, 1]], [[1, 1], [0, 1]]]),
    torch.tensor([[[3, 0], [1, 1]], [[0, 1], [1, 0]], [[3, 1], [1, 1]]]),
]


# The stacked path sums the target rows from the target layers: in float32 for bfloat16 rows
# (2^-24 of each sum), in float64 for float64 rows, as the per-layer path does.
TOLERANCE = {"bf16-gemm": 1e-6, "tf32x3": 1e-8}


def _statistics(group, weighted, stacked, monkeypatch, precision="tf32x3"):
    """GroupStatistics over three training batches (attention weights when `weighted`) and one
    held-out batch, on the stacked head axis or layer by layer."""
    monkeypatch.setattr(group_module, "stacks_heads", lambda inputs, precision, device: stacked)
    stats = GroupStatistics(group, MATCHED, None, (HS, DS, HT, DT), weighted, None, precision)
    assert (stats.heads is not None) == stacked
    g = torch.Generator().manual_seed(7)
    for seed in range(4):
        src, tgt, src_rows, tgt_rows = _batch(seed)
        heldout = seed == 3
        r = None if heldout else [torch.rand(3, HT, 30, generator=g, dtype=torch.float64) for _ in range(4)]
        stats.add(PairedKV(src, src, tgt, tgt, src_rows, tgt_rows, heldout, r, r))
    return list(stats.accumulators())


def _fields(moments) -> dict:
    """Every tensor of SufficientStats or WeightedMoments, by name."""
    names = ("xtx", "xty", "sum_x", "sum_y", "sum_yy", "sum_w")
    if not isinstance(moments, WeightedMoments):
        return {name: getattr(moments, name) for name in names}
    out = {
        f"{part}.{name}": getattr(getattr(moments, part), name)
        for part in ("plain", "by_r")
        for name in names
    }
    return out | {"n": moments.n, "sum_r": moments.sum_r, "sum_r2": moments.sum_r2}


@pytest.mark.parametrize("weighted", [True, False])
@pytest.mark.parametrize("group", [[0, 1, 2, 3], [1, 3]])
@pytest.mark.parametrize("precision", GEMM_PRECISIONS)
def test_stacked_heads_equal_each_layers_own_statistics(monkeypatch, weighted, group, precision):
    monkeypatch.setattr(gram_module, "_CHUNK_BYTES", 4096)  # several chunks per batch on both paths
    stacked = _statistics(group, weighted, True, monkeypatch, precision)
    own = _statistics(group, weighted, False, monkeypatch, precision)
    tol = TOLERANCE[precision] if precision == "bf16-gemm" else 1e-10
    assert [a.layer for a in stacked] == [a.layer for a in own] == group
    for a, b in zip(stacked, own):
        for split in ("train", "heldout"):
            for kind in "kv":
                got, want = _fields(getattr(a, split)[kind]), _fields(getattr(b, split)[kind])
                assert got.keys() == want.keys()
                for name in want:
                    assert got[name].shape == want[name].shape, (a.layer, split, kind, name)
                    torch.testing.assert_close(got[name], want[name], rtol=tol, atol=tol)
        assert float(a.heldout["k"].sum_w.min()) == 3 * 25 - 7
        for kind in "kv":  # the weighted combination (alpha per head) and the maps it solves
            combined, alphas = a.training_moments(kind), a.alphas.get(kind)
            ref, ref_alphas = b.training_moments(kind), b.alphas.get(kind)
            if ref_alphas is None:  # unweighted: no combination (pytest >= 9.1 refuses approx(None))
                assert alphas is None
            else:
                assert alphas == pytest.approx(ref_alphas, rel=1e-10)
            for name, value in _fields(ref).items():
                torch.testing.assert_close(_fields(combined)[name], value, rtol=tol, atol=tol)
        got, want = a.solve(1e-3), b.solve(1e-3)
        for name in ("key_weight", "key_bias", "value_weight", "value_bias"):
            torch.testing.assert_close(getattr(got, name), getattr(want, name), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("precision", GEMM_PRECISIONS)
@pytest.mark.parametrize("weighting", ["attention", "uniform"])
def test_cachebridge_fit_through_stacked_heads_gives_the_per_layer_maps(monkeypatch, weighting, precision):
    """Matched heads (4 source KV heads -> 2 target heads), two source layers per target layer."""
    src, tgt = tiny_model("qwen2", seed=1, num_key_value_heads=4), tiny_model("llama", seed=2)
    tok = byte_tokenizer()
    config = FitConfig(method="cachebridge", num_sequences=6, seq_len=40, layers_k=2, weighting=weighting)
    config = config.replace(stats_precision=precision)
    tol = TOLERANCE[precision]
    bridges = {}
    for stacked in (True, False):
        monkeypatch.setattr(group_module, "stacks_heads", lambda inputs, precision, device, on=stacked: on)
        bridges[stacked] = fit_bridge(src, tgt, tok, tok, config, progress=False)
    new, old = bridges[True], bridges[False]
    rows = "bfloat16" if precision == "bf16-gemm" else "float64"
    label = f"per-head GEMMs on {rows} rows, float64 totals"
    assert new.calibration["statistics"] == old.calibration["statistics"] == label
    assert new.calibration.get("alpha") == old.calibration.get("alpha")
    assert any(len({tuple(h) for h in layer.inputs[:, :, 1].tolist()}) > 1 for layer in new.layers)
    for a, b in zip(new.layers, old.layers):
        assert a.source_layers == b.source_layers and torch.equal(a.inputs, b.inputs)
        for name in ("key_weight", "key_bias", "value_weight", "value_bias"):
            torch.testing.assert_close(getattr(a, name), getattr(b, name), rtol=tol, atol=tol)
        assert a.r2_key == pytest.approx(b.r2_key, rel=tol)
        assert a.r2_value == pytest.approx(b.r2_value, rel=tol)
