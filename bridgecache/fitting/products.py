"""How the statistics' GEMMs form their products: the precision of the rows they multiply.

Two precisions take the GEMM paths (bridgecache.fitting.gram; the fused kernel's "tf32" and
"bf16" are another path):
- "bf16-gemm" (the default): rows rounded to bfloat16, whose products are exact in float32; on
  CUDA each GEMM sums one chunk of rows in float32 on the tensor cores and its result is added
  to the float64 totals; on the CPU the same rounded rows are kept in float64 and multiplied in
  float64 (the CPU has no fast bfloat16 GEMM; converting per GEMM would cost more than the GEMM).
- "tf32x3": rows and GEMMs in float64 (the totals exact to float64 rounding).

Why rounding loses nothing the maps can see: the rows are first shifted near their mean
(core.Shift), so rounding errs by about 2^-9 of each value's spread, unbiased, and the ridge adds
lam * mean variance (lam = 1e-2 by default) to the same diagonal. `tests/fitting/test_products.py`
bounds the change in the fitted maps; benchmarks/reports/fit-gpu-2026-12-07.md measures both.

Knows tensors only.
"""

from __future__ import annotations

import torch

__all__ = ["GEMM_PRECISIONS", "Products"]

GEMM_PRECISIONS = ("bf16-gemm", "tf32x3")


class Products:
    """The rows' dtype of one precision and the GEMMs that add their moments to float64 totals."""

    def __init__(self, precision: str):
        if precision not in GEMM_PRECISIONS:
            raise ValueError(f"precision must be one of {GEMM_PRECISIONS} here, got {precision!r}")
        self.low = precision == "bf16-gemm"

    def row_bytes(self, device) -> int:
        """Bytes per gathered element on `device` (bfloat16 on CUDA, float64 elsewhere)."""
        return 2 if self.low and torch.device(device or "cpu").type == "cuda" else 8

    def rows(self, x: torch.Tensor) -> torch.Tensor:
        """x as the GEMMs take it: float64, or rounded to bfloat16 (kept in float64 on the CPU)."""
        if not self.low:
            return x.double()
        x = x.bfloat16()
        return x if x.is_cuda else x.double()

    def weighted(self, x: torch.Tensor, w: torch.Tensor | None) -> torch.Tensor:
        """Rows x [..., m, p] (from `rows`) times weights w [..., m] (None: x), as `rows` gives them."""
        if w is None:
            return x
        if self.low:  # the weights rounded too: bfloat16 x bfloat16 is exact before its rounding
            return self.rows(x * w.bfloat16().to(x.dtype)[..., None])
        return x * w[..., None]

    def add_gram(self, total: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
        """total [..., p, q] (float64) += a^T b over the rows: a [..., m, p], b [..., m, q]."""
        at = a.transpose(-1, -2)
        if a.dtype == torch.bfloat16:
            # bf16 products summed in float32 by the tensor cores; the chunk's sum added in float64
            total += (torch.bmm if a.dim() == 3 else torch.mm)(at, b, out_dtype=torch.float32)
        else:
            (total.baddbmm_ if total.dim() == 3 else total.addmm_)(at, b)

    @staticmethod
    def sum(x: torch.Tensor, dim: int) -> torch.Tensor:
        """x summed over `dim`, to be added to float64 totals: bfloat16 rows in float32 (one
        kernel; a float64 sum of bfloat16 would first copy the rows to float64), others in float64."""
        return x.sum(dim, dtype=torch.float32 if x.dtype == torch.bfloat16 else torch.float64)

    def weighted_sums(self, y: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(sum w y, sum w y*y) over the rows of y [n, m, d] with weights w [n, m]: [n, d] each.

        bfloat16 rows (CUDA): two batched GEMMs summing in float32, w y and w y*y as the diagonal
        of y^T (w y) (the weighted rows rounded to bfloat16), so no float32 or float64 copy of the
        rows is made; float64 rows: in float64."""
        if y.dtype != torch.bfloat16:
            yw = y * w[..., None]
            return yw.sum(1), (yw * y).sum(1)
        yw = self.weighted(y, w)  # [n, m, d] bfloat16
        sums = torch.bmm(w.bfloat16()[:, None, :], y, out_dtype=torch.float32)[:, 0]
        squares = torch.bmm(y.transpose(1, 2), yw, out_dtype=torch.float32).diagonal(dim1=1, dim2=2)
        return sums, squares
