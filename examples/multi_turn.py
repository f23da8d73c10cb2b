"""A handoff in the middle of a conversation: the source read the earlier turns, the target goes on.

    python examples/multi_turn.py                                       # Qwen2.5-Coder 1.5B -> 0.5B
    python examples/multi_turn.py --source smollm2-135m --target qwen2.5-coder-0.5b --bridge DIR

The earlier turns (a user sharing a harbour log, an acknowledgement) were read by the source,
through ITS chat template. The target's cache of the same turns, in the target's own template, is
translated from the source's (tokenalign's chat alignment pairs the message contents; template
scaffolding is computed by the target). The target then answers several more user turns on that
same cache: each turn feeds only the new tokens. With --native (default) the target also runs the
whole conversation on its own, for comparison.

The bridge: --bridge (a directory, builtin:NAME or hub id), else the built-in bridge of the pair
if bridgecache ships one, else one fitted here (--calib-seqs x --seq-len tokens).
"""

from __future__ import annotations

import argparse

import torch

from bridgecache import Bridge, FitConfig, fit_bridge, load_model
from bridgecache.bridge.builtin import builtin_names
from bridgecache.runtime.entry.conversation import Conversation

LOG = (
    "Harbour log, Port Ellis. On the night of the storm three ships passed: the Marigold, carrying "
    "copper to the south; the Heron, a fishing boat with a red sail; and the Alder, which lost its "
    "mast near the rocks and was towed into the harbour at dawn by the Heron's crew."
)
EARLIER = [
    {"role": "user", "content": f"Here is last night's harbour log. Please keep it in mind.\n\n{LOG}"},
    {"role": "assistant", "content": "I have read the harbour log and will keep it in mind."},
]
QUESTIONS = (
    "Which ship lost its mast?",
    "Who towed it into the harbour?",
    "What was the Marigold carrying?",
    "Describe the Heron in a few words.",
)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description="Hand a conversation over mid-way and keep chatting.")
    parser.add_argument(
        "--source", default="qwen2.5-coder-1.5b", help="the model that read the earlier turns"
    )
    parser.add_argument("--target", default="qwen2.5-coder-0.5b", help="the model that continues the chat")
    parser.add_argument("--bridge", help="directory, builtin:NAME or hub id (default: built-in, else fit)")
    parser.add_argument("--turns", type=int, default=3, help=f"further user turns (at most {len(QUESTIONS)})")
    parser.add_argument("--max-new-tokens", type=int, default=40)
    parser.add_argument("--calib-seqs", type=int, default=32, help="calibration sequences (fitting)")
    parser.add_argument("--seq-len", type=int, default=256, help="tokens per calibration sequence (fitting)")
    parser.add_argument("--no-native", action="store_true", help="skip the target-only comparison")
    args = parser.parse_args(argv)
    if not 1 <= args.turns <= len(QUESTIONS):
        parser.error(f"--turns must be between 1 and {len(QUESTIONS)}")

    source, source_tok = load_model(args.source)
    target, target_tok = load_model(args.target)
    shipped = f"{args.source}->{args.target}"
    if args.bridge or shipped in builtin_names():
        bridge = Bridge.from_pretrained(args.bridge or f"builtin:{shipped}")
    else:
        print(f"fitting a bridge {shipped} ({args.calib_seqs} x {args.seq_len} tokens)")
        bridge = fit_bridge(
            source,
            target,
            source_tok,
            target_tok,
            FitConfig(num_sequences=args.calib_seqs, seq_len=args.seq_len),
            source_name=args.source,
            target_name=args.target,
        )

    # 1. The source has read the earlier turns; the target's cache of them is translated from its KV.
    torch.manual_seed(0)
    chat = Conversation.handoff(
        bridge, source, target, EARLIER, source_tokenizer=source_tok, target_tokenizer=target_tok
    )
    handed = chat.ids.shape[1] - 1  # all but the held-back last token; refreshed at the first question
    print(
        f"{args.source} read {len(EARLIER)} earlier turns; {args.target} holds {handed} of their tokens, "
        "translated (the first question chooses which to refresh)"
    )

    # 2. The target keeps going, turn after turn, on the same cache.
    native = None if args.no_native else Conversation.native(target, target_tok, EARLIER)
    gen = dict(max_new_tokens=args.max_new_tokens, do_sample=False)
    for question in QUESTIONS[: args.turns]:
        turn = chat.ask(question, **gen)
        print(f"\nuser   : {question}")
        cost = f"{turn.reused} cached tokens reused, {turn.fed} read, {turn.seconds:.2f} s"
        print(f"bridged: {turn.answer!r}  ({cost})")
        if native is not None:
            print(f"native : {native.ask(question, **gen).answer!r}")
    return {
        "handed_over": handed,
        "turns": [vars(turn) for turn in chat.turns],
        "native": [turn.answer for turn in native.turns] if native is not None else None,
        "cached": chat.cache.get_seq_length(),
        "tokens": chat.ids.shape[1],
        "messages": chat.messages,
    }


if __name__ == "__main__":
    main()
