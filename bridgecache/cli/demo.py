"""`bridgecache demo`: a real handoff on CPU, offline, that shows what a handoff is for.

The source model reads a long document (default ~1,500 target tokens of reference prose with a
few invented facts on their own lines); the target then answers a question whose answer is
stated only in that document, once after reading it itself (native prefill) and once from the
source's translated cache (bridged, with a source-guided refresh of the tokens the question
points at). Both paths run once before they are timed (first-call costs are printed apart), the
time to the first answer token is compared side by side, and a last line says, in the user's
terms, whether the bridged answer is right and how much sooner it came on this machine.

Knows the zoo, bridges, handoff and the built-in fact generator; it prints, nothing else.
"""

from __future__ import annotations

import sys
import time

import torch

from bridgecache.bridge.recipe import CHOICES, FitConfig
from bridgecache.cli.handoff_flags import add_handoff_arguments, config_problem, handoff_config
from bridgecache.untrusted import printable

__all__ = ["add_demo_command", "run_demo"]

DEFAULT_PAIR = ("qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b")


def add_demo_command(subparsers):
    demo = subparsers.add_parser("demo", help="a real handoff between two built-in models on CPU (offline)")
    demo.add_argument(
        "--source", help=f"model that reads the context (default: the bridge's, else {DEFAULT_PAIR[0]})"
    )
    demo.add_argument(
        "--target", help=f"model that answers from it (default: the bridge's, else {DEFAULT_PAIR[1]})"
    )
    demo.add_argument(
        "--bridge",
        help="bridge directory, builtin:SOURCE->TARGET or hub id (default: the built-in bridge of the pair)",
    )
    demo.add_argument(
        "--method",
        default=FitConfig.method,
        choices=CHOICES["method"],
        help="method when no bridge is shipped for the pair and one is fitted (once; default: FitConfig's)",
    )
    demo.add_argument("--context-tokens", type=int, default=1536, help="length of the built-in document")
    demo.add_argument("--context", help="your own document (then give --question and, to check, --answer)")
    demo.add_argument("--question", help="a question about the document")
    demo.add_argument("--answer", help="the expected answer (checked in both outputs)")
    add_handoff_arguments(demo)
    demo.add_argument("--max-new-tokens", type=int, default=16)
    demo.set_defaults(func=run_demo)
    return demo


def _document(args, target_tok) -> tuple[str, str, str | None]:
    """(context, question, expected answer or None)."""
    if args.context:
        return args.context, args.question, args.answer
    from bridgecache.evaluation.builtin import builtin_items

    item = builtin_items(f"facts-choice-{args.context_tokens}", target_tok, limit=1)[0]
    return item.context, item.question, item.choices[item.answer]


class _DemoError(Exception):
    """What stops the demo before any model loads (exit status 2)."""


def _check_args(args) -> None:
    """Raise _DemoError for the first option that cannot work (before anything loads)."""
    if args.context and not args.question:
        raise _DemoError("--context needs --question")
    if args.context is None and not 64 <= args.context_tokens <= 8192:
        raise _DemoError(f"--context-tokens is {args.context_tokens}; expected an integer in [64, 8192]")
    if args.max_new_tokens < 1:
        raise _DemoError(f"--max-new-tokens is {args.max_new_tokens}; expected an integer >= 1")


def _bridge_and_models(args, config):
    from bridgecache.bridge.builtin import check_models
    from bridgecache.bridge.maps import Bridge
    from bridgecache.fitting.options import check_model_reference
    from bridgecache.models import zoo

    _check_args(args)
    name = args.bridge
    if name is None:
        source_name, target_name = args.source or DEFAULT_PAIR[0], args.target or DEFAULT_PAIR[1]
        name = f"builtin:{source_name}->{target_name}"
    bridge = None
    try:
        bridge = Bridge.from_pretrained(name)
    except Exception as err:  # noqa: BLE001 - any reason a bridge cannot load is reported, then we fit
        if args.bridge is not None:
            raise _DemoError(f"--bridge: {err}") from err
        print(f"no built-in bridge {name} ({printable(str(err), 500)}); fitting one once", file=sys.stderr)
    problem = config_problem(config, bridge) if bridge is not None else None
    if problem:
        raise _DemoError(problem)
    source_name = args.source or (bridge.source.name if bridge else DEFAULT_PAIR[0])
    target_name = args.target or (bridge.target.name if bridge else DEFAULT_PAIR[1])
    for role, name, given in (("source", source_name, args.source), ("target", target_name, args.target)):
        problem = check_model_reference(name, zoo.BUILTIN_MODELS)
        if problem and given:  # checked before a model loads: a wrong name costs nothing
            raise _DemoError(f"--{role}: {problem}")
        if problem:
            raise _DemoError(f"no --{role} given, and the bridge's {role} model cannot be loaded: {problem}")
    source, source_tok = zoo.load_model(source_name)
    target, target_tok = zoo.load_model(target_name)
    if bridge is None:
        from bridgecache.fitting.cached import bridge_for

        bridge = bridge_for(source_name, target_name, FitConfig(method=args.method), source, target)
    check_models(bridge, source, target, source_tok, target_tok)
    return bridge, (source_name, source, source_tok), (target_name, target, target_tok)


_WARM_UP = "A short warm-up document: both paths read it once before anything is timed.\n"


class _FirstToken:
    """A generate() streamer that records the seconds from `start()` to the first new token."""

    def start(self) -> _FirstToken:
        self.began, self.seconds, self._calls = time.perf_counter(), None, 0
        return self

    def put(self, value) -> None:
        self._calls += 1  # generate() first puts the prompt, then each new token
        if self._calls == 2 and self.seconds is None:
            self.seconds = time.perf_counter() - self.began

    def end(self) -> None:
        if self.seconds is None:
            self.seconds = time.perf_counter() - self.began


def _timed(fn):
    start = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - start


@torch.no_grad()
def run_demo(args) -> int:
    from bridgecache.kv.capture import capture_kv
    from bridgecache.runtime.entry.handoff import align_context, handoff

    torch.manual_seed(0)
    try:
        config = handoff_config(args)
    except ValueError as err:
        print(f"bridgecache demo: error: {printable(str(err), 2000)}", file=sys.stderr)
        return 2
    try:
        bridge, (source_name, source, source_tok), (target_name, target, target_tok) = _bridge_and_models(
            args, config
        )
    except _DemoError as err:
        print(f"bridgecache demo: error: {printable(str(err), 2000)}", file=sys.stderr)
        return 2
    context, question, expected = _document(args, target_tok)
    prompt = f"\nQuestion: {question}\nAnswer:"
    pad = target_tok.pad_token_id if target_tok.pad_token_id is not None else target_tok.eos_token_id
    greedy = dict(do_sample=False, pad_token_id=pad)
    ids = target_tok(context + prompt, return_tensors="pt")["input_ids"]
    _, source_ids, _ = align_context(bridge, context, source_tok, target_tok)
    source_kv, source_s = _timed(lambda: capture_kv(source, source_ids))

    def native(text: str, streamer=None):
        ids = target_tok(text, return_tensors="pt")["input_ids"]
        out = target.generate(ids, max_new_tokens=args.max_new_tokens, streamer=streamer, **greedy)
        return target_tok.decode(out[0, ids.shape[1] :], skip_special_tokens=True).strip()

    def bridged(document: str, question_prompt: str, cache=None, streamer=None):
        return handoff(
            bridge,
            source,
            target,
            document,
            question_prompt,
            source_tokenizer=source_tok,
            target_tokenizer=target_tok,
            source_kv=cache,
            config=config,
            max_new_tokens=args.max_new_tokens,
            streamer=streamer,
            **greedy,
        )

    # First calls pay one-off costs (lazy initialisation, plans, rope tables): a short warm-up
    # through both paths, timed apart, before the document is timed.
    _, native_warm = _timed(lambda: native(_WARM_UP + prompt))
    _, bridged_warm = _timed(lambda: bridged(_WARM_UP, prompt))
    clock = _FirstToken()
    native_text = native(context + prompt, clock.start())
    native_ttft = clock.seconds
    result = bridged(context, prompt, source_kv, clock.start())
    bridged_ttft, bridged_text = clock.seconds, result.text.strip()
    report = result.cache.report()
    print(
        f"\nsource {printable(source_name)}  ->  target {printable(target_name)}   ({bridge.method} bridge)"
    )
    print(f"document: {ids.shape[1]} target tokens with the question; {source_ids.shape[1]} source tokens")
    print(f"question: {question}" + (f"   (expected: {expected})" if expected else ""))
    print(f"\nnative  : {native_text!r}")
    print(f"bridged : {bridged_text!r}\n")
    print("what the bridged cache did:\n  " + str(report).replace("\n", "\n  ") + "\n")
    speedup = native_ttft / bridged_ttft
    rows = [
        ("source prefill of the document (paid once, before the handoff)", source_s),
        ("target native: time to first token", native_ttft),
        ("bridged: time to first token (source reads the question, translate, one forward)", bridged_ttft),
        (
            "first calls on a short warm-up text: native / bridged",
            f"{native_warm:.3f} / {bridged_warm:.3f} s",
        ),
    ]
    width = max(len(name) for name, _ in rows)
    for name, value in rows:
        print(f"  {name:<{width}}  " + (f"{value:7.3f} s" if isinstance(value, float) else value))
    print(f"  {'time-to-first-token ratio (native / bridged)':<{width}}  {speedup:7.2f} x\n")
    hint_longer = args.context is None and args.context_tokens < 4096
    print(_verdict(expected, native_text, bridged_text, speedup, config.refresh, hint_longer))
    return 0


def _verdict(expected, native_text, bridged_text, speedup, refresh, hint_longer: bool) -> str:
    """One line in the user's terms: was the bridged answer right, and how much sooner it came."""
    timing = _timing(speedup)
    longer = "; the handoff saves more on longer documents: --context-tokens 4096" if hint_longer else ""
    if expected is None:
        return f"result: {timing} (no --answer given, so neither answer was checked){longer}."
    correct = lambda text: expected.lower() in text.lower()  # noqa: E731
    if correct(bridged_text):
        after = "as after reading" if correct(native_text) else "which it missed after reading"
        answer = f"the bridged target answered {expected!r}, {after} the document itself"
    elif correct(native_text):
        amount = refresh.amount if refresh is not None and isinstance(refresh.amount, float) else 0.05
        answer = (
            f"the bridged answer missed {expected!r}, which the target found after reading the document "
            f"itself; refreshing more of the document (--refresh {min(1.0, 2 * amount):.2f}) brings it closer"
        )
    else:
        answer = (
            f"the target misses {expected!r} even after reading the document itself, so this question "
            "is beyond it (a larger target would do better)"
        )
    return f"result: {answer}; {timing}{longer}."


def _timing(speedup: float) -> str:
    """The time-to-first-token ratio in words (native seconds / bridged seconds)."""
    than = "the target reading the document itself, on this machine"
    if speedup >= 1.05:
        return f"{speedup:.1f}x sooner to the first token than {than}"
    if speedup > 1 / 1.05:
        return f"about as soon to the first token as {than}"
    return (
        f"{1 / speedup:.1f}x later to the first token than {than} (reading the question with the "
        "source and refreshing tokens cost more than a document this short saves)"
    )
