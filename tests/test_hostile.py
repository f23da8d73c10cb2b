"""Every public entry driven with hostile values (hypothesis): wrong types, NaN and infinities,
negative and huge numbers, empty, huge and lone-surrogate strings, links, a FIFO and /dev/zero.
Each call gives a correct result or the boundary's error: a TypeError or ValueError (the library's
own errors derive from them) naming what is wrong, raised before any model runs. Never an
AttributeError, KeyError, IndexError or RuntimeError from inside, never a hang (each call has 20
s), never a forward of the models on a refused call.

The CLI (`bridgecache.cli.main`, in-process) gets a hostile value for every option of every
command; it must exit with status 0, 1 or 2 (argparse's own refusals: SystemExit(2)) or reach
the point where it would load a model (the zoo's load_model is replaced by one that stops there:
no model is loaded, nothing is downloaded), with the cache root in a temporary folder.

Deterministic (derandomize=True) and about a minute on one CPU thread in all."""

from __future__ import annotations

import argparse
import atexit
import functools
import math
import os
import shutil
import signal
import tempfile
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tiny_models import byte_tokenizer, random_bridge, tiny_model

import bridgecache as bc
from bridgecache.models import zoo
from bridgecache.runtime.gate import QualityPolicy
from bridgecache.runtime.selection.rules import Selector

SETTINGS = dict(
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
    database=None,
)
MESSAGES = [{"role": "user", "content": "The boat is red."}]


def _paths(root: Path) -> list[Path]:
    """Special files: a FIFO (opening it to read blocks without a writer), a link to /dev/zero
    (endless), a dangling link, a directory, an empty file; and /dev/zero, /dev/null themselves."""
    fifo, zero, dangling, folder, empty = (root / n for n in ("fifo", "zero", "dangling", "dir", "empty"))
    if not fifo.exists():
        os.mkfifo(fifo)
        zero.symlink_to("/dev/zero")
        dangling.symlink_to(root / "nowhere")
        folder.mkdir()
        empty.write_bytes(b"")
    return [fifo, zero, dangling, folder, empty, Path("/dev/zero"), Path("/dev/null")]


_ROOT = Path(tempfile.mkdtemp(prefix="bridgecache-hostile-"))
atexit.register(shutil.rmtree, _ROOT, ignore_errors=True)
PATHS = _paths(_ROOT)

TEXT = st.one_of(
    st.text(max_size=12),
    st.text(st.characters(codec=None, categories=["Cs", "Cc", "Zs"]), min_size=1, max_size=4),  # surrogates
    st.sampled_from(["", " ", "x" * 200_000, "\x00", "\u202e", "builtin:../../etc", "../..", "-1", "nan"]),
)
NUMBER = st.one_of(
    st.integers(-(2**70), 2**70),
    st.integers(-1, 4),  # values near the valid ones: some calls run to a result
    st.sampled_from([0, -1, 1, 2**31, 2**63, 10**9]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([math.nan, math.inf, -math.inf, -0.0, 1e-300]),
)
HOSTILE = st.one_of(
    st.none(),
    st.booleans(),
    NUMBER,
    TEXT,
    st.sampled_from(PATHS),
    st.sampled_from([str(p) for p in PATHS]),
    st.binary(max_size=8),
    st.lists(st.one_of(NUMBER, TEXT, st.none()), max_size=3),
    st.dictionaries(st.text(max_size=3), NUMBER, max_size=2),
    st.sampled_from(
        [
            torch.tensor([[math.nan]]),
            torch.zeros(0),
            torch.ones(2, 3, 4),
            torch.tensor([[-1, 5]]),
            torch.tensor([[10**6]]),
            torch.ones(1, 3, dtype=torch.bool),
            object(),
            int,
            [[1, 2]],
            (),
            {"role": "user"},
        ]
    ),
)

# The library's refusals derive from these (FieldTypeError, MismatchError, KVFileError, ...).
BOUNDARY = (TypeError, ValueError)
# Errors that read as "something inside broke", never as "your input is wrong".
INSIDE = (AttributeError, KeyError, IndexError, RuntimeError, AssertionError, RecursionError, MemoryError)


@contextmanager
def _at_most(seconds: int):
    """A hang (reading a FIFO, /dev/zero) becomes a failure, not a stuck suite."""

    def stop(*_):
        raise TimeoutError(f"no answer in {seconds} s")

    old = signal.signal(signal.SIGALRM, stop)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


class _Answer(Selector):
    """A custom rule whose native_layers() or scores() answer a hostile value."""

    name = "hostile"

    def __init__(self, layers=(), scores=None):
        self.layers, self.given = layers, scores

    def native_layers(self, num_layers):
        return self.layers

    def scores(self, request):
        return self.given


@pytest.fixture(scope="module")
def world():
    model = tiny_model("llama")
    tok = byte_tokenizer()
    tok.chat_template = "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
    bridge = random_bridge(model)
    engine = bc.HandoffEngine(bridge, model, model, source_tokenizer=tok, target_tokenizer=tok)
    ids = torch.tensor([[1, 2, 3, 4, 5, 6]])
    kv = bc.capture_kv(model, ids)
    calls = []
    model.model.register_forward_hook(lambda *_: calls.append(1))
    return dict(model=model, tok=tok, bridge=bridge, engine=engine, ids=ids, kv=kv, calls=calls)


def _entries(w) -> dict:
    """name -> a call of one public entry with the hostile value `x` in one place (the rest valid)."""
    m, tok, bridge, engine, ids, kv = w["model"], w["tok"], w["bridge"], w["engine"], w["ids"], w["kv"]
    gen = dict(max_new_tokens=1, do_sample=False)

    def hand(**changes):
        args = dict(bridge=bridge, source=m, target=m, context="ctx", prompt="q") | changes
        models = [args.pop(k) for k in ("bridge", "source", "target", "context", "prompt")]
        return lambda: bc.handoff(*models, source_tokenizer=tok, target_tokenizer=tok, **(gen | args))

    def cache(**changes):
        args = dict(bridge=bridge, source_kv=kv, target=m, target_ids=ids) | changes
        return lambda: bc.BridgedCache(
            args.pop("bridge"), args.pop("source_kv"), args.pop("target"), args.pop("target_ids"), **args
        )

    return {
        "HandoffEngine(bridge)": lambda x: lambda: bc.HandoffEngine(x, m, m),
        "HandoffEngine(source)": lambda x: lambda: bc.HandoffEngine(bridge, x, m),
        "HandoffEngine(target)": lambda x: lambda: bc.HandoffEngine(bridge, m, x),
        "HandoffEngine(source_tokenizer)": lambda x: (
            lambda: bc.HandoffEngine(bridge, m, m, source_tokenizer=x)
        ),
        "HandoffEngine(config)": lambda x: lambda: bc.HandoffEngine(bridge, m, m, config=x),
        "HandoffEngine(graph_bytes)": lambda x: lambda: bc.HandoffEngine(bridge, m, m, graph_bytes=x),
        "handoff(bridge)": lambda x: hand(bridge=x),
        "handoff(target)": lambda x: hand(target=x),
        "handoff(context)": lambda x: hand(context=x),
        "handoff(prompt)": lambda x: hand(prompt=x),
        "handoff(config)": lambda x: hand(config=x),
        "handoff(source_kv)": lambda x: hand(source_kv=x),
        "handoff(max_new_tokens)": lambda x: hand(max_new_tokens=x),
        "handoff(num_beams)": lambda x: hand(num_beams=x),
        "handoff_batch(contexts)": lambda x: (
            lambda: bc.handoff_batch(bridge, m, m, x, "q", source_tokenizer=tok, target_tokenizer=tok, **gen)
        ),
        "BridgedCache(bridge)": lambda x: cache(bridge=x),
        "BridgedCache(source_kv)": lambda x: cache(source_kv=x),
        "BridgedCache(target)": lambda x: cache(target=x),
        "BridgedCache(target_ids)": lambda x: cache(target_ids=x),
        "BridgedCache(config)": lambda x: cache(config=x),
        "BridgedCache(alignment)": lambda x: cache(alignment=x),
        "BridgedCache(target_attention_mask)": lambda x: cache(target_attention_mask=x),
        "BridgedCache(source_attention_mask)": lambda x: cache(source_attention_mask=x),
        "BridgedCache(prompt_ids)": lambda x: cache(prompt_ids=x, source_model=m),
        "BridgedCache(source_model)": lambda x: cache(source_model=x),
        "BridgedCache(words)": lambda x: cache(words=x),
        "BridgedCache(engine)": lambda x: cache(engine=x),
        "selector.native_layers()": lambda x: cache(
            config=bc.HandoffConfig(refresh=bc.RefreshConfig(by=_Answer(layers=x))), source_model=m
        ),
        "selector.scores()": lambda x: cache(
            config=bc.HandoffConfig(refresh=bc.RefreshConfig(by=_Answer(scores=x))), source_model=m
        ),
        "Conversation.handoff(messages)": lambda x: (
            lambda: bc.Conversation.handoff(bridge, m, m, x, source_tokenizer=tok, target_tokenizer=tok)
        ),
        "Conversation.handoff(config)": lambda x: (
            lambda: bc.Conversation.handoff(
                bridge, m, m, MESSAGES, source_tokenizer=tok, target_tokenizer=tok, config=x
            )
        ),
        "Conversation.handoff(engine)": lambda x: (
            lambda: bc.Conversation.handoff(
                bridge, m, m, MESSAGES, source_tokenizer=tok, target_tokenizer=tok, engine=x
            )
        ),
        "Conversation.native(messages)": lambda x: lambda: bc.Conversation.native(m, tok, x),
        "Conversation.ask(content)": lambda x: lambda: bc.Conversation.native(m, tok, MESSAGES).ask(x, **gen),
        "Conversation.score(replies)": lambda x: (
            lambda: bc.Conversation.native(m, tok, MESSAGES).score("q", x)
        ),
        "engine.handoff(context)": lambda x: lambda: engine.handoff(x, "q", **gen),
        "engine.handoff_batch(contexts)": lambda x: lambda: engine.handoff_batch(x, "q", **gen),
        "engine.translate_context(context)": lambda x: lambda: engine.translate_context(x),
        "engine.request(contexts)": lambda x: lambda: engine.request(x),
        "engine.measure_route(lengths)": lambda x: lambda: engine.measure_route(lengths=x, progress=False),
        "engine.time_routes(tokens)": lambda x: lambda: engine.time_routes(bc.HandoffConfig(), x),
        "engine.route_costs(config)": lambda x: lambda: engine.route_costs(x),
        "engine.cache(request)": lambda x: lambda: engine.cache(x),
        "engine.generate(input_ids)": lambda x: functools.partial(
            engine.generate, engine.translate_context("ab")[0], x, None
        ),  # the cache is made before the call (the source's forward is not the call's)
        "HandoffConfig(native_head)": lambda x: lambda: bc.HandoffConfig(native_head=x),
        "HandoffConfig(native_tail)": lambda x: lambda: bc.HandoffConfig(native_tail=x),
        "HandoffConfig(native_layers)": lambda x: lambda: bc.HandoffConfig(native_layers=x),
        "HandoffConfig(key_norm)": lambda x: lambda: bc.HandoffConfig(key_norm=x),
        "HandoffConfig(refresh)": lambda x: lambda: bc.HandoffConfig(refresh=x),
        "HandoffConfig(quality)": lambda x: lambda: bc.HandoffConfig(quality=x),
        "HandoffConfig(route)": lambda x: lambda: bc.HandoffConfig(route=x),
        "RefreshConfig(amount)": lambda x: lambda: bc.RefreshConfig(amount=x),
        "RefreshConfig(by)": lambda x: lambda: bc.RefreshConfig(by=x),
        "RefreshConfig(whole_words)": lambda x: lambda: bc.RefreshConfig(whole_words=x),
        "QualityPolicy(min_quality)": lambda x: lambda: QualityPolicy(min_quality=x),
        "QualityPolicy(max_native_fraction)": lambda x: lambda: QualityPolicy(max_native_fraction=x),
        "SourceAttention(layers)": lambda x: lambda: bc.SourceAttention(layers=x),
        "KeyDeviation(check_layer)": lambda x: lambda: bc.KeyDeviation(check_layer=x),
        "GivenScores(values)": lambda x: lambda: bc.GivenScores(x),
        "FitConfig(num_sequences)": lambda x: lambda: bc.FitConfig(num_sequences=x),
        "FitConfig(seq_len)": lambda x: lambda: bc.FitConfig(seq_len=x),
        "FitConfig(method)": lambda x: lambda: bc.FitConfig(method=x),
        "FitConfig(text)": lambda x: lambda: bc.FitConfig(text=x),
        "fit_bridge(source_model)": lambda x: lambda: bc.fit_bridge(x, m, tok, tok, progress=False),
        "fit_bridge(config)": lambda x: lambda: bc.fit_bridge(m, m, tok, tok, x, progress=False),
        "capture_kv(model)": lambda x: lambda: bc.capture_kv(x, ids),
        "capture_kv(input_ids)": lambda x: lambda: bc.capture_kv(m, x),
        "capture_kv(attention_mask)": lambda x: lambda: bc.capture_kv(m, ids, x),
        "as_source(source)": lambda x: lambda: bc.as_source(x),
        "load_kv(path)": lambda x: lambda: bc.load_kv(x),
        "tokenize_context(text)": lambda x: lambda: bc.tokenize_context(bridge, x, tok, tok),
        "align_context(text)": lambda x: lambda: bc.align_context(bridge, x, tok, tok),
        "model_spec(model)": lambda x: lambda: bc.model_spec(x),
        "model_spec(tokenizer)": lambda x: lambda: bc.model_spec(m, x),
        "Bridge.identity(model)": lambda x: lambda: bc.Bridge.identity(x),
        "Bridge.from_pretrained(name_or_path)": lambda x: (
            lambda: bc.Bridge.from_pretrained(x, local_files_only=True)
        ),
    }


ENTRY_NAMES = sorted(_entries({k: None for k in ("model", "tok", "bridge", "engine", "ids", "kv")}))


def _check_call(call, name: str, value, calls: list) -> None:
    calls.clear()
    try:
        with _at_most(20):
            call()
    except BOUNDARY as err:
        if isinstance(err, INSIDE):
            raise
        assert str(err), f"{name} with {value!r}: an empty message"
        assert not calls, f"{name} with {value!r}: refused after {len(calls)} forward(s) of the model: {err}"
    except INSIDE as err:
        raise AssertionError(f"{name} with {value!r:.80}: {type(err).__name__} from inside: {err}") from err


@settings(max_examples=4000, **SETTINGS)
@given(name=st.sampled_from(ENTRY_NAMES), value=HOSTILE)
def test_every_public_entry_gives_a_result_or_the_boundarys_error(world, name, value):
    call = _entries(world)[name](value)
    _check_call(call, name, value, world["calls"])


class _WouldLoad(Exception):
    """Raised where a command would load a model: its arguments were all accepted."""


def _cli_options() -> list[tuple[list[str], str, str]]:
    """(the command's words, one option taking a value, its dest) for every option of every command."""
    from bridgecache.cli import _build_parser

    found = []

    def walk(parser, words):
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, sub in action.choices.items():
                    walk(sub, [*words, name])
            elif action.nargs != 0 and not isinstance(action, argparse._HelpAction):
                found.append((words, action.option_strings[0] if action.option_strings else "", action.dest))

    walk(_build_parser(), [])
    return found


CLI_OPTIONS = _cli_options()
CLI_TEXT = st.one_of(TEXT, st.sampled_from([str(p) for p in PATHS]), NUMBER.map(str))
BRIDGE = "builtin:smollm2-135m->qwen2.5-coder-0.5b"
# Each command's other arguments valid, so that the hostile value is the one judged.
BASE = {
    "demo": [],
    "fit": ["--source", "smollm2-135m", "--target", "qwen2.5-coder-0.5b"],
    "eval": ["--bridge", BRIDGE, "--data", "builtin:facts-choice", "--limit", "2"],
    "inspect": [BRIDGE],
}


@settings(max_examples=450, **SETTINGS)
@given(option=st.sampled_from(CLI_OPTIONS), value=CLI_TEXT)
def test_every_cli_option_gives_a_status_or_reaches_the_work(option, value, tmp_path, monkeypatch):
    from bridgecache.cli import main

    def would_load(*args, **kwargs):
        raise _WouldLoad

    monkeypatch.chdir(tmp_path)  # a relative --plot or --json lands here, not in the checkout
    monkeypatch.setenv("BRIDGECACHE_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(zoo, "load_model", would_load)
    monkeypatch.setattr("bridgecache.bridge.hub.download", would_load)
    words, flag, dest = option
    if flag:
        argv = [*words, *BASE.get(words[0], []), flag, value]
    else:  # a positional: export-builtin's name follows its (empty) source folder
        argv = [*words, *([str(tmp_path)] if dest == "name" else []), value]
    if words[0] == "fit" and flag != "--out":
        argv += ["--out", str(tmp_path / "out")]
    try:
        with _at_most(20):
            status = main(argv)
    except SystemExit as stop:  # argparse's refusal of a value (status 2), or --help (0)
        assert stop.code in (0, 2), f"{argv!r:.200}: exit {stop.code}"
    except _WouldLoad:
        pass
    except INSIDE as err:
        raise AssertionError(f"{argv!r:.200}: {type(err).__name__} from inside: {err}") from err
    else:
        assert status in (0, 1, 2), f"{argv!r:.200}: status {status!r}"
