"""The `bridgecache eval` subcommand: measure a bridge on a data file or a built-in task.

    bridgecache eval --bridge DIR --data FILE.jsonl|builtin:NAME [--task ppl|choice|generate] [--limit N]
                     [--json OUT] [--source NAME --target NAME] [--chat] [--no-progress]
                     [--arms all|ARM [ARM ...]]
                     [--controls FILE] [handoff flags: --native-head N --native-tail N --no-key-norm
                     --native-layers N|L+L+..|all --refresh FRACTION|TOKENS|none
                     --refresh-by source|deviation --[no-]whole-words --[no-]word-ends --min-quality Q
                     --route auto|handoff|native]

The handoff flags make one `HandoffConfig`, with its defaults (a 20% refresh chosen by the
source's attention, whole words with the token that ends each), as every other path. Models come
from the bridge's metadata (`bridge.source.name`, `bridge.target.name`: a built-in name, hub id or
local directory) unless --source/--target say otherwise. --arms adds the evidence arms of
`bridgecache.evaluation.arms` (source alone, translation only, chosen tokens alone, wrong document,
random map; choice and ppl tasks) with the gap recovered and paired differences. Generation tasks
are answered after native prefill, no context, another item's context and the bridged cache.
Prints the table of `report.format_table`; --json writes `report.summarise`'s object. Every
option, the bridge, the data, the model names, the controls file and both output paths (--json,
--controls: never an input, a folder of one, or a file that holds something else) are checked
before a model loads; errors exit with status 2 and one line naming the file, line and field.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

from bridgecache.cli.handoff_flags import add_handoff_arguments, config_problem, handoff_config
from bridgecache.evaluation.arms import EXTRA_ARMS, check_arms
from bridgecache.files import replace_file
from bridgecache.untrusted import printable

__all__ = ["add_eval_command", "run_eval"]


def add_eval_command(subparsers) -> argparse.ArgumentParser:
    """Register `eval` on the `bridgecache` command's subparsers."""
    parser = subparsers.add_parser(
        "eval",
        help="measure a bridge against native, no-context and unrelated-context controls",
        description=__doc__.split("\n\n")[0],
    )
    parser.add_argument("--bridge", required=True, help="bridge directory (bridge.json + bridge.safetensors)")
    parser.add_argument(
        "--data",
        required=True,
        help="JSONL file, or builtin:NAME (prose-ppl, code-ppl, facts-choice, needle; -N for N context "
        "tokens, e.g. builtin:facts-choice-1024, builtin:needle-4096)",
    )
    parser.add_argument(
        "--task", choices=["ppl", "choice", "generate"], help="required for a file; implied by builtin:"
    )
    parser.add_argument("--limit", type=int, help="evaluate the first N items")
    parser.add_argument("--json", type=Path, help="write the results (with per-item records) here")
    parser.add_argument("--source", help="source model (default: the bridge's source)")
    parser.add_argument("--target", help="target model (default: the bridge's target)")
    parser.add_argument(
        "--chat", action="store_true", help="read contexts and questions through each model's chat template"
    )
    parser.add_argument(
        "--arms",
        nargs="+",
        metavar="ARM",
        help=f"extra arms: 'all' or names from {', '.join(EXTRA_ARMS)} (choice and ppl tasks)",
    )
    add_handoff_arguments(parser)
    parser.add_argument(
        "--controls",
        type=Path,
        help="JSON file remembering native/no-context/unrelated scores (later runs repeat only bridged work)",
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.set_defaults(func=run_eval)
    return parser


def _json_safe(value):
    """NaN -> null, recursively (JSON has no NaN)."""
    if isinstance(value, float) and math.isnan(value):
        return None
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    return value


def _short(name: str) -> str:
    """A model name for people: the directory name of a path (escaped: it may come from a file)."""
    return printable(Path(name).name if "/" in name and Path(name).exists() else name, 200)


def check_model_names(names) -> str | None:
    """The first (flag, model name) that cannot possibly load, in words; None if none."""
    from bridgecache.fitting.options import check_model_reference
    from bridgecache.models.zoo import BUILTIN_MODELS

    for flag, name in names:
        problem = check_model_reference(name, BUILTIN_MODELS)
        if problem:
            return f"{flag}: {problem}"
    return None


def _check_outputs(args) -> str | None:
    """Why --json or --controls cannot be written (None: both can): not creatable, the same file
    as an input or as each other, inside the bridge's or a model's folder, or (--json) an existing
    file that is not an earlier result (a data file, a bridge.json) would be overwritten."""
    from bridgecache.files import writable_file

    inputs = [
        ("--data", args.data),
        ("--bridge", args.bridge),
        ("--source", args.source),
        ("--target", args.target),
    ]
    inputs = [
        (flag, Path(value)) for flag, value in inputs if value and not str(value).startswith("builtin:")
    ]
    outputs = [(flag, path) for flag, path in (("--json", args.json), ("--controls", args.controls)) if path]
    for flag, path in outputs:
        problem = writable_file(path)
        if problem:
            return f"{flag}: {problem}"
        for other, source in inputs:
            if _same_or_inside(path, source):
                return f"{flag} {path} is {other} {source} or lies inside it; write the output elsewhere"
    if len(outputs) == 2 and outputs[0][1].resolve() == outputs[1][1].resolve():
        return f"--json and --controls are the same file ({args.json}); give each its own"
    if args.json is not None and args.json.is_file() and not _is_result(args.json):
        return (
            f"--json {args.json} holds something else than an eval result; it is left as it is: "
            "write elsewhere"
        )
    return None


def _same_or_inside(path: Path, other: Path) -> bool:
    """Whether `path` is the file `other` or lies under the folder `other` (links resolved)."""
    try:
        path, other = path.resolve(), other.resolve()
    except (OSError, RuntimeError):
        return False
    if not other.exists():
        return False
    return path == other or (other.is_dir() and other in path.parents)


def _is_result(path: Path) -> bool:
    """Whether `path` holds what an earlier `eval --json` wrote (so overwriting it is expected)."""
    try:
        with open(path, "rb") as f:
            head = f.read(1)
        if head != b"{":
            return False
        result = json.loads(path.read_text())
    except (OSError, ValueError, RecursionError):
        return False
    return isinstance(result, dict) and {"task", "n", "variant", "method"} <= set(result)


def run_eval(args) -> int:
    from bridgecache.bridge.builtin import check_models
    from bridgecache.bridge.maps import Bridge, BridgeFormatError
    from bridgecache.evaluation.data import data_task, load_items
    from bridgecache.evaluation.items import EvaluationError
    from bridgecache.evaluation.report import format_table, summarise
    from bridgecache.evaluation.runner import ControlScores, Variant, evaluate
    from bridgecache.models.zoo import load_model

    def fail(err) -> int:
        print(f"bridgecache eval: error: {printable(str(err), 2000)}", file=sys.stderr)
        return 2

    builtin = args.data.startswith("builtin:")
    problem = _check_outputs(args)  # before anything is read: a late failure would lose the run
    if args.limit is not None and args.limit < 1:
        problem = problem or f"--limit is {args.limit}; expected an integer >= 1"
    arms = ("all" if args.arms == ["all"] else args.arms) if args.arms else None
    if problem:
        return fail(problem)
    try:  # everything that can be checked before the models load (seconds to minutes)
        config = handoff_config(args)
        bridge = Bridge.from_pretrained(args.bridge)
        task = data_task(args.data, args.task)
        items = None if builtin else load_items(args.data, task, limit=args.limit)[1]
        controls = ControlScores(args.controls)  # a damaged file is refused now, not mid-run
        # names, task and --chat now; one tokenizer for a ppl task's source alone once they load
        check_arms(arms, task, same_tokenizer=True, chat=args.chat)
    except (BridgeFormatError, EvaluationError, OSError, ValueError) as err:
        return fail(err)
    source_name = args.source or bridge.source.name
    target_name = args.target or bridge.target.name
    problem = config_problem(config, bridge)
    names = [
        (flag if given else f"the bridge's {flag[2:]} model (no {flag} given)", name)
        for flag, given, name in (
            ("--source", args.source, source_name),
            ("--target", args.target, target_name),
        )
    ]
    problem = problem or check_model_names(names)
    if problem:
        return fail(problem)
    target, target_tok = load_model(target_name)
    source, source_tok = (target, target_tok) if source_name == target_name else load_model(source_name)
    check_models(bridge, source, target, source_tok, target_tok)
    variant = Variant(bridge, config)
    try:
        if builtin:
            items = load_items(args.data, task, target_tok, args.limit)[1]
        evaluation = evaluate(
            source, source_tok, target, target_tok, items, task, [variant],
            chat=args.chat, progress=not args.no_progress, controls=controls, arms=arms,
        )  # fmt: skip
    except (EvaluationError, ValueError) as err:
        return fail(err)
    summary = summarise(
        evaluation,
        variant,
        source=_short(source_name),
        target=_short(target_name),
        data=args.data,
        chat=args.chat,
    )
    print(format_table(summary))
    if args.json:
        text = json.dumps(_json_safe(summary), indent=1)
        try:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            replace_file(args.json, text)  # a failure half-way leaves no half file under its name
        except OSError as err:  # checked up front, but the disk can fill: never lose the records
            import tempfile

            fd, rescue = tempfile.mkstemp(prefix="bridgecache-unsaved-", suffix=".json")
            with open(fd, "w") as f:
                f.write(text)
            print(
                f"bridgecache eval: error: could not write {args.json} ({err}); wrote {rescue}",
                file=sys.stderr,
            )
            return 1
        print(f"\nwrote {args.json}")
    return 0
