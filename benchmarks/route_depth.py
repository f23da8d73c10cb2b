"""How deep the route from `handoff()` to the apply kernel is: Python frames on the stack when the
first `map_heads` / `map_layers` call starts, counted from the `handoff` frame (itself included).

    cd /tmp && python /path/to/benchmarks/route_depth.py        # tiny random models, CPU, seconds

The counted handoff is the setup's second (the first also builds what later ones reuse).
Counted with `sys.setprofile`: at the first call event whose function is `map_heads` or
`map_layers`, the frames from it up to the outermost `handoff` frame; printed by module so the
transformers share (generate(), the decoder, its layers, the attention module) and ours are apart;
and every call of a bridgecache / tokenalign function until then (tokenizing, checks, planning).
"""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from tiny_models import byte_tokenizer, tiny_model  # noqa: E402

from bridgecache import handoff  # noqa: E402
from bridgecache.bridge.maps import Bridge  # noqa: E402

KERNELS = {"map_heads", "map_layers"}


def route() -> tuple[list[str], int]:
    """The frames (module:function) from handoff() down to the first apply-kernel call, and how
    many calls of bridgecache's own functions ran before it (the host work on the way)."""
    found: list[str] = []
    ours = [0]

    def watch(frame, event, arg):
        if event != "call" or found:
            return
        if frame.f_globals.get("__name__", "").startswith(("bridgecache", "tokenalign")):
            ours[0] += 1
        if frame.f_code.co_name not in KERNELS:
            return
        stack, f = [], frame
        while f is not None:
            stack.append(f"{f.f_globals.get('__name__', '?')}:{f.f_code.co_name}")
            f = f.f_back
        top = max(i for i, name in enumerate(stack) if name.endswith(":handoff"))
        found.extend(stack[: top + 1])

    model = tiny_model("qwen2", max_position_embeddings=4096)
    bridge = Bridge.identity(model)
    bridge.method = "fullhead"  # the default refresh runs, as with a fitted bridge
    tok = byte_tokenizer()
    text = "the ship came in at dawn with salt and rope, and 1234 barrels " * 3
    # once before counting: a setup's first handoff also builds what later ones reuse
    handoff(bridge, model, model, text, " and", source_tokenizer=tok, target_tokenizer=tok, max_new_tokens=1)
    sys.setprofile(watch)
    try:
        handoff(
            bridge, model, model, text, " and", source_tokenizer=tok, target_tokenizer=tok, max_new_tokens=1
        )
    finally:
        sys.setprofile(None)
    return found, ours[0]


def main() -> None:
    torch.manual_seed(0)
    frames, calls = route()
    print(f"frames from handoff() to the apply kernel: {len(frames)}")
    print(f"calls of bridgecache's and tokenalign's own functions before it: {calls}")
    by_package = Counter(
        name.split(".")[0] if not name.startswith("bridgecache") else name.rsplit(":")[0] for name in frames
    )
    for package, count in by_package.most_common():
        print(f"  {count:3d}  {package}")
    print("\n".join(f"    {name}" for name in reversed(frames)))


if __name__ == "__main__":
    main()
