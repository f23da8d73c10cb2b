"""Adversarial inputs of issue 40, per class: which ones the code at hand handles correctly.

    cd /tmp && PYTHONPATH=<checkout> OMP_NUM_THREADS=1 python <checkout>/benchmarks/adversarial_inputs.py

Each case builds the bad input as a user would (tiny random models, a byte tokenizer: nothing is
downloaded) and says "ok" when the code refuses it with a clear error at the entry (or, for the
ranking class, refreshes what the selector ranked first), else what happened. Runs on any
bridgecache checkout (a case that needs a name the checkout lacks reports it), so the same
command tallies the code before and after a change. Prints one line per case and a tally per
class; the tests in tests/test_reliability_{inputs,words,publish,eval,storage}.py assert the
same cases.
"""

from __future__ import annotations

import contextlib
import io
import json
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # tiny_models
from tiny_models import byte_tokenizer, tiny_model  # noqa: E402

from bridgecache import BridgedCache, HandoffConfig, RefreshConfig, capture_kv  # noqa: E402
from bridgecache.bridge.maps import Bridge, LayerMap  # noqa: E402
from bridgecache.models.spec import model_spec  # noqa: E402
from bridgecache.runtime.gate import QualityPolicy  # noqa: E402
from bridgecache.runtime.selection.rules import GivenScores, KeyDeviation, Selector, SourceAttention  # noqa: E402
from bridgecache.runtime.selection.words import context_words  # noqa: E402

CASES: list[tuple[str, str, object]] = []


def case(cls: str, name: str):
    def register(fn):
        CASES.append((cls, name, fn))
        return fn

    return register


def refused(make, *errors) -> str:
    """ok if `make()` raises one of `errors` (TypeError/ValueError by default)."""
    expected = errors or (TypeError, ValueError)
    try:
        make()
    except expected as err:
        return "ok" if not isinstance(err, AttributeError) else f"{type(err).__name__}: {err}"
    except Exception as err:  # noqa: BLE001
        return f"{type(err).__name__}: {str(err)[:100]}"
    return "accepted"


# ------------------------------------------------------------------ 1. values checked where they enter
CONFIGS = {
    "HandoffConfig(key_norm='false')": lambda: HandoffConfig(key_norm="false"),
    "HandoffConfig(one_launch='no')": lambda: HandoffConfig(one_launch="no"),
    "HandoffConfig(native_head='3')": lambda: HandoffConfig(native_head="3"),
    "HandoffConfig(native_layers=[0, '1'])": lambda: HandoffConfig(native_layers=[0, "1"]),
    "HandoffConfig(refresh={'amount': 0.1})": lambda: HandoffConfig(refresh={"amount": 0.1}),
    "HandoffConfig(quality={})": lambda: HandoffConfig(quality={}),
    "RefreshConfig(by=None)": lambda: RefreshConfig(by=None),
    "RefreshConfig(amount=nan)": lambda: RefreshConfig(amount=float("nan")),
    "QualityPolicy(min_quality='0.7')": lambda: QualityPolicy(min_quality="0.7"),
    "QualityPolicy(min_quality=nan)": lambda: QualityPolicy(min_quality=float("nan")),
    "QualityPolicy(min_coverage=2)": lambda: QualityPolicy(min_coverage=2),
    "SourceAttention(reduce='mean')": lambda: SourceAttention(reduce="mean"),
    "KeyDeviation(check_layer='1')": lambda: KeyDeviation(check_layer="1"),
    "GivenScores(NaN scores)": lambda: GivenScores(torch.tensor([[0.0, float("nan")]])),
}
for _name, _make in CONFIGS.items():
    case("1 values at entry", _name)(lambda make=_make: refused(make))


def _random_bridge(model, seed=1):
    gen = torch.Generator().manual_seed(seed)
    spec = model_spec(model)
    heads, dim = spec.num_kv_heads, spec.head_dim
    layers = []
    for _ in range(spec.num_layers):
        inputs = torch.stack(
            [
                torch.randint(0, spec.num_layers, (heads, 2), generator=gen),
                torch.randint(0, heads, (heads, 2), generator=gen),
            ],
            dim=-1,
        )
        w = lambda: torch.randn(heads, 2 * dim, dim, generator=gen) / (2 * dim) ** 0.5  # noqa: E731
        b = lambda: torch.randn(heads, dim, generator=gen)  # noqa: E731
        layers.append(LayerMap(sorted({int(x) for x in inputs[..., 0].unique()}), inputs, w(), b(), w(), b()))
    return Bridge(spec, spec, "cachebridge", "identity", layers)


LLAMA = tiny_model("llama", vocab_size=258, initializer_range=0.3)
TOK = byte_tokenizer()
BRIDGE = _random_bridge(LLAMA)


def refreshed(text, by, amount, **options):
    ids = TOK(text, return_tensors="pt")["input_ids"]
    refresh = RefreshConfig(amount, by=by, **options)
    words = context_words(text, TOK, TOK, ids, ids)
    cache = BridgedCache(
        BRIDGE, capture_kv(LLAMA, ids), LLAMA, ids, config=HandoffConfig(refresh=refresh), words=words
    )
    return cache.refreshed_columns[0].tolist(), cache


class Returns(Selector):
    name = "returns"

    def __init__(self, make):
        self.make = make

    def scores(self, request):
        prefix = getattr(request, "prefix_length", None)  # the engine's request; before it, the translator's
        return self.make(prefix if prefix is not None else request.translator.prefix_length)


for _name, _make in {
    "custom Selector scores [1, 1] (broadcast)": lambda p: torch.ones(1, 1),
    "custom Selector scores [prefix] (1-D)": lambda p: torch.ones(p),
    "custom Selector NaN scores": lambda p: torch.full((1, p), float("nan")),
}.items():
    case("1 values at entry", _name)(
        lambda make=_make: refused(lambda: refreshed("a few words here", Returns(make), 3))
    )


def _lmcache_world_size_zero():
    from lmcache.v1.config import LMCacheEngineConfig

    from bridgecache.integrations.lmcache import LMCachePublisher

    return refused(lambda: LMCachePublisher(LMCacheEngineConfig.from_defaults(chunk_size=4), world_size=0))


case("1 values at entry", "LMCachePublisher(world_size=0)")(_lmcache_world_size_zero)

SOURCE, TARGET = tiny_model("qwen2", seed=1), tiny_model("qwen2", seed=0)
IDENTITY = Bridge.identity(TARGET)
IDS = torch.randint(3, 300, (1, 25), generator=torch.Generator().manual_seed(0))


def _cache():
    return BridgedCache(IDENTITY, capture_kv(SOURCE, IDS), TARGET, IDS)


def _publish(destination, **kwargs):
    from bridgecache.integrations.publish import publish

    return publish(_cache(), IDS, destination, **({"page_size": 4, "model_name": "tiny"} | kwargs))


@case("1 values at entry", "publish(salt=None)")
def _salt_none():
    with tempfile.TemporaryDirectory() as d:
        try:
            _publish(d, salt=None)
        except (TypeError, ValueError) as err:
            return "ok" if "salt" in str(err) else f"{type(err).__name__} not naming salt: {str(err)[:80]}"
        except Exception as err:  # noqa: BLE001
            return f"{type(err).__name__}: {str(err)[:80]}"
        return "accepted"


@case("1 values at entry", "publish_context(config=dict)")
def _context_config_dict():
    from bridgecache.integrations.publish import publish_context

    with tempfile.TemporaryDirectory() as d:
        return refused(
            lambda: publish_context(
                IDENTITY,
                "a b c d e",
                TARGET,
                TOK,
                TOK,
                d,
                page_size=4,
                model_name="t",
                source=SOURCE,
                config={"refresh": None},
            )  # fmt: skip
        )


def _entry(name: str, *args, **kwargs):
    """Call bridgecache.<name>(IDENTITY, SOURCE, TARGET, *args, ...) with the source watched."""
    import bridgecache

    def ran(*a, **k):
        raise RuntimeError("the source ran before the input was refused")

    hook = SOURCE.model.register_forward_pre_hook(ran)  # capture_kv runs the decoder alone
    try:
        getattr(bridgecache, name)(
            IDENTITY,
            SOURCE,
            TARGET,
            *args,
            source_tokenizer=TOK,
            target_tokenizer=TOK,
            max_new_tokens=1,
            **kwargs,
        )
    except RuntimeError as err:
        return str(err)
    except (TypeError, ValueError):
        return "ok"
    finally:
        hook.remove()
    return "accepted"


case("1 values at entry", "handoff_batch('one text') (a str, not a list)")(
    lambda: _entry("handoff_batch", "one text")
)
case("1 values at entry", "handoff_batch([])")(lambda: _entry("handoff_batch", []))
case("1 values at entry", "handoff(config=dict)")(
    lambda: _entry("handoff", "a b c", "q", config={"refresh": None})
)
case("1 values at entry", "handoff(context=None)")(lambda: _entry("handoff", None, "q"))


# ------------------------------------------------------------------ 2. limits before the work
@contextlib.contextmanager
def _forbidden(module, name):
    real = getattr(module, name)

    def forbid(*a, **k):
        raise RuntimeError(f"{name} ran before the input was refused")

    setattr(module, name, forbid)
    try:
        yield
    finally:
        setattr(module, name, real)


@case("2 limits first", "publish_context of a context past the target's window")
def _window():
    from bridgecache.integrations.publish import publish_context

    def ran(*args, **kwargs):
        raise RuntimeError("the source ran before the input was refused")

    text = "x" * (IDENTITY.target.max_position_embeddings + 1)
    hook = SOURCE.model.register_forward_pre_hook(ran)  # capture_kv runs the decoder alone
    try:
        with tempfile.TemporaryDirectory() as d:
            publish_context(IDENTITY, text, TARGET, TOK, TOK, d, page_size=4, model_name="t", source=SOURCE)
    except RuntimeError as err:
        return str(err)
    except ValueError:
        return "ok"
    finally:
        hook.remove()
    return "accepted"


case("2 limits first", "handoff of a context past the target's window")(
    lambda: _entry("handoff", "x" * (IDENTITY.target.max_position_embeddings + 1), "q")
)


def _before_materialise(destination, **kwargs):
    cache = _cache()
    cache.materialize = lambda: (_ for _ in ()).throw(RuntimeError("translated before refusing"))
    from bridgecache.integrations.publish import publish

    try:
        publish(cache, IDS, destination, **({"page_size": 4, "model_name": "tiny"} | kwargs))
    except RuntimeError as err:
        return str(err)
    except (TypeError, ValueError, OSError):
        return "ok"
    return "accepted"


@case("2 limits first", "publish to a HiCacheStorage without layout=")
def _hicache_layout():
    from sglang.srt.mem_cache.hicache_storage import HiCacheFile

    with tempfile.TemporaryDirectory() as d:
        return _before_materialise(HiCacheFile(_hicache_config(d)))


@case("2 limits first", "publish to a path that is a file")
def _file_destination():
    with tempfile.NamedTemporaryFile() as f:
        return _before_materialise(f.name)


@case("2 limits first", "publish(dtype='bfloat16')")
def _dtype_string():
    with tempfile.TemporaryDirectory() as d:
        return _before_materialise(d, dtype="bfloat16")


@case("2 limits first", "eval --controls with a damaged entry, before any model")
def _controls_entry():
    from bridgecache.evaluation.controls import ControlScores

    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "c.json"
        path.write_text(json.dumps({"ab" * 32: {"native": "x", "native_prefill_s": 0.1}}))
        return refused(lambda: ControlScores(path))


# ------------------------------------------------------------------ 3. writers that verify
def _eval_argv(folder: Path, **outputs):
    spec = model_spec(tiny_model("qwen2"), name="qwen2.5-coder-0.5b")
    bridge = Bridge.identity(spec).save_pretrained(folder / "bridge")
    data = folder / "data.jsonl"
    data.write_text(json.dumps({"context": "a b c", "continuation": "d"}) + "\n")
    names = {"data": data, "bridge.json": bridge / "bridge.json", "new": folder / "new.json"}
    argv = ["eval", "--bridge", str(bridge), "--data", str(data), "--task", "ppl"]
    for flag, target in outputs.items():
        argv += [f"--{flag}", str(names[target])]
    return argv, names


def _eval_refuses(**outputs):
    from bridgecache.cli import main
    from bridgecache.models import zoo

    with (
        tempfile.TemporaryDirectory() as d,
        _forbidden(zoo, "load_model"),
        contextlib.redirect_stderr(io.StringIO()),
    ):
        argv, names = _eval_argv(Path(d), **outputs)
        before = {k: p.read_bytes() for k, p in names.items() if p.exists()}
        try:
            code = main(argv)
        except RuntimeError:
            return "accepted (went on to load the models)"
        after = {k: p.read_bytes() for k, p in names.items() if p.exists()}
        return "ok" if code == 2 and after == before else f"exit {code}"


case("3 writers", "eval --json at the data file")(lambda: _eval_refuses(json="data"))
case("3 writers", "eval --json at the bridge's bridge.json")(lambda: _eval_refuses(json="bridge.json"))
case("3 writers", "eval --controls at the data file")(lambda: _eval_refuses(controls="data"))
case("3 writers", "eval --json and --controls one file")(lambda: _eval_refuses(json="new", controls="new"))


def _hicache_config(directory):
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig

    return HiCacheStorageConfig(
        tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1, is_mla_model=False,
        enable_storage_metrics=False, is_page_first_layout=False, model_name="tiny",
        extra_config={"file_storage_path": str(directory)},
    )  # fmt: skip


@case("3 writers", "HiCacheFile on a full disk (short writes reported as stored)")
def _short_write():
    from sglang.srt.mem_cache.hicache_storage import HiCacheFile

    class FullDisk(HiCacheFile):
        def set(self, key, value=None, target_location=None, target_sizes=None):
            return super().set(key, value.reshape(-1)[: value.numel() // 2])

    with tempfile.TemporaryDirectory() as d:
        return refused(lambda: _publish(FullDisk(_hicache_config(d)), layout="layer_first"), RuntimeError)


@case("3 writers", "HiCacheFile holding an earlier truncated copy")
def _truncated_copy():
    from sglang.srt.mem_cache.hicache_storage import HiCacheFile

    with tempfile.TemporaryDirectory() as d:
        with contextlib.suppress(Exception):
            _publish(HiCacheFile(_hicache_config(d)), layout="layer_first")
        for page in Path(d).glob("*.bin"):
            page.write_bytes(page.read_bytes()[:100])
        return refused(lambda: _publish(HiCacheFile(_hicache_config(d)), layout="layer_first"), RuntimeError)


@case("3 writers", "two dtypes of one context into one page store")
def _two_dtypes():
    from bridgecache.integrations.pages import PageStore, read_context

    with tempfile.TemporaryDirectory() as d:
        _publish(d, dtype=torch.float32)
        _publish(d, dtype=torch.bfloat16)
        manifests = PageStore(d).manifests
        try:
            for m in manifests:
                read_context(m)
        except ValueError as err:
            return f"unreadable: {str(err)[:80]}"
        return "ok" if len(manifests) == 2 else f"{len(manifests)} publication(s) left of 2"


@case("3 writers", "a tensors file replaced while publishing")
def _replaced():
    publishing = sys.modules.get("bridgecache.integrations.publish") or __import__(
        "bridgecache.integrations.publish", fromlist=["x"]
    )
    real = publishing.write_new_file

    def racing(path, data):
        out = real(path, data)
        if Path(path).suffix == ".safetensors":
            real(path, bytes(data[:-8]) + b"\0" * 8)
        return out

    publishing.write_new_file = racing
    try:
        with tempfile.TemporaryDirectory() as d:
            return refused(lambda: _publish(d), OSError, ValueError)
    finally:
        publishing.write_new_file = real


# ------------------------------------------------------------------ 4. ranking kept by whole words
def _top_column(text, column, amount, **options):
    scores = torch.rand(1, len(text.encode()), generator=torch.Generator().manual_seed(amount)) * 0.1
    scores[0, column] = 1.0
    chosen, _ = refreshed(text, GivenScores(scores), amount, **options)
    return "ok" if column in chosen else f"refreshed {chosen[:6]}..., not column {column}"


JAPANESE = "東京都の天気は晴れです明日の会議は午後三時に始まりますので遅れないでください"
THREE = len(JAPANESE[: JAPANESE.index("三")].encode())
for _amount in (1, 3, 21):
    case("4 ranking", f"Japanese run without spaces, {_amount} token(s)")(
        lambda amount=_amount: _top_column(JAPANESE, THREE, amount)
    )
BLOB = (
    "the key is " + "QUJDREVGR0hJSktMTU5PUFFSU1RVVldYWVphYmNkZWZnaGlqa2xtbm9wcXJzdHV2d3h5ejAxMjM0NTY3" + " ok"
)
case("4 ranking", "a base64 token in English, 4 tokens")(lambda: _top_column(BLOB, 61, 4))


@case("4 ranking", "a budget that stops inside a word takes its best tokens")
def _inside_word():
    text = "see 918273645 now"
    s = text.index("9")
    scores = torch.zeros(1, len(text))
    scores[0, s + 6], scores[0, s + 7], scores[0, s + 2] = 0.9, 0.5, 0.3
    chosen, _ = refreshed(text, GivenScores(scores), 3, word_ends=False)
    return "ok" if chosen == sorted([s + 2, s + 6, s + 7]) else f"refreshed {chosen}"


@case("4 ranking", "-inf scores: no native column in the budget, the report counts right")
def _minus_inf():
    text = "a few words of context here"
    scores = torch.full((1, len(text)), float("-inf"))
    scores[0, 10] = 1.0
    chosen, cache = refreshed(text, Returns(lambda p: scores[:, :p]), 6, whole_words=False)
    head = int(cache.translator.head_end[0])
    good = min(chosen) >= head and len(set(chosen)) == 6 == cache.report().tokens_refreshed
    return (
        "ok"
        if good
        else f"refreshed {chosen} (native head ends at {head}), reported {cache.report().tokens_refreshed}"
    )


@case("4 ranking", "NaN among a built-in rule's scores ranks last")
def _nan_last():
    from bridgecache.runtime.native_work.pending import pending_columns

    always = torch.tensor([[True, False, False, False]])
    scores = torch.tensor([[0.0, float("nan"), 1.0, 0.5]])
    columns, _ = pending_columns(always, scores, ~always, [1])
    return "ok" if columns[0].tolist() == [0, 2] else f"picked {columns[0].tolist()}"


def main() -> int:
    torch.set_num_threads(1)
    tally: dict[str, list[int]] = {}
    for cls, name, fn in CASES:
        try:
            result = fn()
        except Exception as err:  # noqa: BLE001
            result = f"{type(err).__name__}: {str(err)[:100]}"
        tally.setdefault(cls, [0, 0])[0] += 1
        tally[cls][1] += result == "ok"
        print(f"[{cls}] {name}: {result}")
    print()
    for cls, (tried, ok) in tally.items():
        print(f"{cls}: {tried} tried, {ok} correct")
    return 0


if __name__ == "__main__":
    sys.exit(main())
