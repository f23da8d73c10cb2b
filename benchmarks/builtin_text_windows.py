"""How many calibration windows the built-in text (bridgecache.text, split "calib") holds.

    python benchmarks/builtin_text_windows.py --tokenizer DIR_OR_HUB_ID [--seq-lens 256 512 1024 2048]

Prints a markdown table: windows of each domain at each seq_len (the "mixed" domain holds the
sum: prose and code alternate, then code fills), for one tokenizer, with the Python version
whose shipped text it counts. docs/fitting.md quotes it.
"""

from __future__ import annotations

import argparse
import platform
import time

from transformers import AutoTokenizer

from bridgecache.text import builtin_windows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokenizer", required=True)
    ap.add_argument("--seq-lens", type=int, nargs="+", default=[256, 512, 1024, 2048])
    args = ap.parse_args()
    tok = AutoTokenizer.from_pretrained(args.tokenizer)
    print(f"tokenizer {args.tokenizer} ({len(tok)} tokens), Python {platform.python_version()}, "
          f"{time.strftime('%Y-%m-%d')}\n")  # fmt: skip
    print("| seq_len | prose windows | code windows | mixed (both) |\n|---:|---:|---:|---:|")
    for seq_len in args.seq_lens:
        counts = {d: sum(1 for _ in builtin_windows(tok, seq_len, d, "calib", 0)) for d in ("prose", "code")}
        print(
            f"| {seq_len} | {counts['prose']} | {counts['code']} | {counts['prose'] + counts['code']} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
