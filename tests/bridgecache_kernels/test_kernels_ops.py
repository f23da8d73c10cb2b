"""bridgecache.kernels as torch operators and as a package: custom-op registration (opcheck, fake
tensors), backend dispatch, argument checks, and the import boundary (no models, no tokenizers)."""

from __future__ import annotations

import ast
import pathlib

import bridgecache.kernels as K
import pytest
import torch
from bridgecache.kernels import SufficientStats, map_fullhead, map_heads, map_layers
from bridgecache.kernels._dispatch import ENV_VAR, resolve_backend
from torch._subclasses.fake_tensor import FakeTensorMode

KERNELS_DIR = pathlib.Path(K.__file__).parent


def small_inputs(gen=None):
    gen = gen or torch.Generator().manual_seed(0)
    src = torch.randn(1, 2, 5, 32, generator=gen)
    rows = torch.tensor([[0, -1, 4, 4, 2]])
    heads = torch.tensor([[1], [0], [1]])
    weight = torch.randn(3, 32, 64, generator=gen)
    bias = torch.randn(3, 64, generator=gen)
    sc = torch.rand(1, 5, 32, generator=gen).cos()
    ss = torch.rand(1, 5, 32, generator=gen).sin()
    tc = torch.rand(1, 5, 64, generator=gen).cos()
    ts = torch.rand(1, 5, 64, generator=gen).sin()
    return src, rows, heads, weight, bias, sc, ss, tc, ts


def test_opcheck_gathered_affine():
    src, rows, heads, weight, bias, sc, ss, tc, ts = small_inputs()
    out = torch.empty(1, 1, 3, 5, 64)
    cos5 = sc[:, None, None].expand(1, 1, 2, 5, 32)
    sin5 = ss[:, None, None].expand(1, 1, 2, 5, 32)
    layouts = ("interleaved", 16, "half", 48)  # source, target: (kind, rotary_dim)
    args = ([src], rows, heads[None], weight[None], bias[None], cos5, sin5, tc[None], ts[None], "torch",
            *layouts, out)  # fmt: skip
    torch.library.opcheck(torch.ops.bridgecache.gathered_affine.default, args)


def test_opcheck_accumulate_stats():
    src, rows, heads, *_ = small_inputs()
    stats = SufficientStats.zeros(3, 32, 16)
    y = torch.randn(1, 3, 5, 16)
    args = ([src], rows, heads, y, torch.rand(1, 3, 5), None, None, "torch", "tf32x3", "half", 32,
            stats.xtx, stats.xty, stats.sum_x, stats.sum_y, stats.sum_yy, stats.sum_w)  # fmt: skip
    torch.library.opcheck(torch.ops.bridgecache.accumulate_stats.default, args)


def test_fake_tensors_propagate_shapes():
    """Shapes and dtypes come out right without running anything (what torch.compile traces)."""
    with FakeTensorMode() as mode:
        src, rows, heads, weight, bias, sc, ss, tc, ts = (mode.from_tensor(x) for x in small_inputs())
        keys = map_heads(src, rows, heads, weight, bias, sc, ss, tc, ts, out_dtype=torch.bfloat16)
        assert keys.shape == (1, 3, 5, 64) and keys.dtype == torch.bfloat16
        layers = map_layers([src, src], rows, heads[None].expand(4, 3, 1), weight[None].expand(4, 3, 32, 64),
                            bias[None].expand(4, 3, 64))  # fmt: skip
        assert layers.shape == (4, 1, 3, 5, 64) and layers.dtype == torch.float32
        full = map_fullhead(src, rows, torch.zeros(3, 64, 64), bias, out_dtype=torch.float16)
        assert full.shape == (1, 3, 5, 64) and full.dtype == torch.float16
        stats = SufficientStats.zeros(3, 32, 16)
        stats = SufficientStats(*(mode.from_tensor(getattr(stats, f)) for f in stats.__dataclass_fields__))
        stats.update(src, rows, heads, torch.zeros(1, 3, 5, 16))


def test_backend_choice(monkeypatch):
    cpu = torch.device("cpu")
    monkeypatch.delenv(ENV_VAR, raising=False)
    assert resolve_backend(None, cpu) == "torch"
    monkeypatch.setenv(ENV_VAR, "torch")
    assert resolve_backend(None, torch.device("cuda")) == "torch"
    assert resolve_backend("auto", cpu) == "torch"
    monkeypatch.setenv(ENV_VAR, "bogus")
    with pytest.raises(ValueError, match="backend"):
        resolve_backend(None, cpu)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET"):
        resolve_backend("triton", cpu)


def test_a_use_backend_block_chooses_for_its_own_thread_only(monkeypatch):
    import threading

    from bridgecache.kernels import use_backend

    cuda = torch.device("cuda")  # resolve_backend only reads the device's type
    monkeypatch.setenv(ENV_VAR, "auto")
    outside = resolve_backend(None, cuda)
    seen = []
    with use_backend("torch"):
        assert resolve_backend(None, cuda) == "torch"
        thread = threading.Thread(target=lambda: seen.append(resolve_backend(None, cuda)))
        thread.start()
        thread.join()
        monkeypatch.setenv("TRITON_INTERPRET", "1")
        assert resolve_backend("triton", torch.device("cpu")) == "triton"  # an argument still wins
    assert seen == [outside] and resolve_backend(None, cuda) == outside
    with pytest.raises(ValueError, match="backend must be one of"), use_backend("fast"):
        pass


def test_torch_backend_is_the_cpu_default(monkeypatch):
    monkeypatch.delenv(ENV_VAR, raising=False)
    args = small_inputs()
    assert torch.equal(map_heads(*args), map_heads(*args, backend="torch"))


def test_argument_checks(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # let backend="triton" reach the head-dim check
    src, rows, heads, weight, bias, sc, ss, tc, ts = small_inputs()
    with pytest.raises(ValueError, match="weight"):
        map_heads(src, rows, heads, weight[:, :16], bias)
    with pytest.raises(ValueError, match="rows"):
        map_heads(src, rows.int(), heads, weight, bias)
    with pytest.raises(ValueError, match="cos and sin"):
        map_heads(src, rows, heads, weight, bias, sc, None)
    with pytest.raises(ValueError, match="out"):
        map_heads(src, rows, heads, weight, bias, out=torch.empty(1, 3, 4, 64))
    with pytest.raises(ValueError, match="power-of-two"):
        odd = torch.randn(1, 2, 5, 40)
        map_heads(odd, rows, heads, torch.randn(3, 40, 64), bias, backend="triton")


def test_imports_stay_below_bridgecache():
    """kernels/ knows no models or tokenizers: it imports torch, triton and the standard library only."""
    allowed = {"torch", "triton", "__future__", "collections", "contextlib", "contextvars", "dataclasses",
               "functools", "importlib", "logging", "os", "sys", "types"}  # fmt: skip
    for path in KERNELS_DIR.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [] if node.level else [node.module]
            else:
                continue
            for name in names:
                assert name.split(".")[0] in allowed, f"{path.name} imports {name}"


def test_empty_contexts():
    src, rows, heads, weight, bias, *_ = small_inputs()
    none = map_heads(src, rows[:, :0], heads, weight, bias)
    assert none.shape == (1, 3, 0, 64)
    native = map_heads(src[:, :, :0], torch.full((1, 4), -1), heads, weight, bias)
    assert native.shape == (1, 3, 4, 64) and not native.any()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (the Triton kernel)")
def test_compiled_map_heads_matches_eager_on_cuda():
    """torch.compile traces the custom op (eager calls launch Triton directly): same output, also
    for a shape whose launch configuration is first tuned inside the compiled graph."""
    gen = torch.Generator().manual_seed(3)

    def inputs(t):
        src = [torch.randn(1, 2, t + 1, 128, generator=gen).to("cuda", torch.bfloat16) for _ in range(2)]
        angle = torch.rand(1, t + 1, 64, generator=gen) * 6
        target_angle = torch.rand(1, t, 64, generator=gen) * 6
        tables = [
            torch.cat([f(a)] * 2, -1).cuda() for a in (angle, target_angle) for f in (torch.cos, torch.sin)
        ]
        rows = torch.arange(t)[None].cuda()
        heads = torch.tensor([[0], [2]]).cuda()
        weight, bias = (
            torch.randn(2, 128, 128, generator=gen).cuda(),
            torch.randn(2, 128, generator=gen).cuda(),
        )
        return src, rows, heads, weight, bias, *tables

    def mapped(src, rows, heads, weight, bias, sc, ss, tc, ts):
        return map_heads(src, rows, heads, weight, bias, src_cos=sc, src_sin=ss, tgt_cos=tc, tgt_sin=ts) * 2

    compiled = torch.compile(mapped)
    for t in (300, 3000):
        args = inputs(t)
        assert torch.equal(compiled(*args), mapped(*args))
