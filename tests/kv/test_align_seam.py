"""bridgecache.kv.align (gather_rows, pair_rows, target_rows) against a float64 loop reference."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from bridgecache.kv.align import gather_rows, pair_rows, target_rows
from tokenalign import NATIVE, Alignment, TokenSpans, match


def _reference(x: torch.Tensor, alignment: Alignment, policy: str) -> torch.Tensor:
    """Loop over target tokens in float64: the obvious reading of each policy."""
    x = x.double()
    out = torch.zeros(*x.shape[:-2], len(alignment), x.shape[-1], dtype=torch.float64)
    for t in range(len(alignment)):
        if alignment.source_index[t] == NATIVE:
            continue
        start, end = int(alignment.span_start[t]), int(alignment.span_end[t])
        if policy == "last":
            out[..., t, :] = x[..., int(alignment.source_index[t]), :]
        elif policy == "first":
            out[..., t, :] = x[..., start, :]
        else:
            out[..., t, :] = x[..., start:end, :].mean(-2)
    return out


def _random_alignment(rng: np.random.Generator, n_source: int, n_target: int) -> Alignment:
    """Match two random tokenizations of one 200-byte text, with a few control tokens each."""

    def spans(n: int) -> TokenSpans:
        cuts = np.sort(rng.choice(np.arange(1, 200), size=n - 1, replace=False))
        start, end = np.concatenate([[0], cuts]), np.concatenate([cuts, [200]])
        control = rng.random(n) < 0.1
        return TokenSpans(np.where(control, 0, start), np.where(control, 0, end))

    return match(spans(n_source), spans(n_target))


@pytest.fixture
def alignment():
    al = _random_alignment(np.random.default_rng(0), 40, 55)
    assert al.native_mask().any() and (al.span_end - al.span_start > 1).any()  # covers both cases
    return al


@pytest.mark.parametrize("policy", ["last", "first", "mean"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gather_rows_matches_reference(alignment, policy, dtype):
    x = torch.randn(2, 3, alignment.num_source, 8, generator=torch.Generator().manual_seed(1))
    got = gather_rows(x.to(dtype), alignment.with_policy(policy))
    assert got.shape == (2, 3, len(alignment), 8) and got.dtype == dtype
    want = _reference(x.to(dtype), alignment, policy)
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got.double(), want, atol=tol, rtol=tol)
    assert not got[..., alignment.native_mask(), :].any()  # NATIVE rows are zeros


def test_policy_argument_overrides_the_recorded_one(alignment):
    x = torch.randn(1, 1, alignment.num_source, 4)
    torch.testing.assert_close(
        gather_rows(x, alignment, "mean"), gather_rows(x, alignment.with_policy("mean"))
    )
    assert not torch.equal(gather_rows(x, alignment, "mean"), gather_rows(x, alignment, "last"))


def test_mean_is_exact_over_long_contexts():
    """The cumulative sum runs in float64: a late short span keeps float32 accuracy."""
    n = 20_000
    x = torch.randn(1, 1, n, 4, generator=torch.Generator().manual_seed(0)) * 100 + 1000
    al = Alignment([n - 1], [n - 3], [n], num_source=n, policy="mean")
    want = x[0, 0, n - 3 :].double().mean(0)
    # float32 prefix sums reach ~2e7 here, where one float32 step is 2: they would be off by ~1
    torch.testing.assert_close(gather_rows(x, al)[0, 0, 0].double(), want, atol=1e-3, rtol=0)


def test_gather_rows_checks_the_source_length(alignment):
    with pytest.raises(ValueError, match="source rows"):
        gather_rows(torch.zeros(1, 1, alignment.num_source + 1, 4), alignment)


@pytest.mark.parametrize("policy", ["last", "first"])
def test_pair_rows_feeds_the_same_rows_as_gather(alignment, policy):
    src_idx, tgt_idx = pair_rows(alignment, policy)
    assert src_idx.dtype == tgt_idx.dtype == torch.int64
    np.testing.assert_array_equal(tgt_idx.numpy(), np.flatnonzero(~alignment.native_mask()))
    x = torch.randn(1, 2, alignment.num_source, 5, dtype=torch.float64)
    torch.testing.assert_close(x[..., src_idx, :], gather_rows(x, alignment, policy)[..., tgt_idx, :])


def test_pair_rows_refuses_mean_and_target_rows_serves_it(alignment):
    with pytest.raises(ValueError, match="target_rows"):
        pair_rows(alignment.with_policy("mean"))
    assert torch.equal(target_rows(alignment), pair_rows(alignment)[1])


def test_identity_alignment_is_a_copy():
    x = torch.randn(1, 2, 6, 3)
    for policy in ("last", "first", "mean"):
        torch.testing.assert_close(gather_rows(x, Alignment.identity(6, policy)), x)
