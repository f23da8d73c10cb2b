"""One agent reads, the others answer: a reader model reads a long document once, and answering
agents of other families answer questions from bridged copies of its KV cache instead of each
reading the document themselves.

    python examples/multi_agent.py                  # SmolLM2 reads; Qwen2.5 and Gemma 3 answer
    python examples/multi_agent.py --reader smollm2-135m --agents qwen2.5-coder-0.5b gemma3-270m \\
        --ships 64 --bridge-dir bridges

The document is a harbour log (--ships entries); each question asks what one ship carried.
Bridges are loaded from --bridge-dir/<reader>-to-<agent>, or fitted once and saved there.
Prints every answer, then the time saved against every agent prefilling the document itself.
"""

from __future__ import annotations

import argparse
import copy
import itertools
import time
from pathlib import Path

import torch

from bridgecache import Bridge, BridgedCache, capture_kv, fit_bridge, load_model
from bridgecache.runtime.handoff import align_context

ADJECTIVES = ["Silver", "Red", "Little", "Northern", "Swift", "Old", "Golden", "Quiet"]
BIRDS = ["Heron", "Kestrel", "Osprey", "Plover", "Tern", "Puffin", "Curlew", "Wren"]
CARGO = ["copper", "salt", "timber", "wool", "coal", "tea", "grain", "iron", "cotton", "wine", "tin"]
PORTS = ["Lisbon", "Bergen", "Cork", "Riga", "Genoa", "Hull", "Bilbao", "Malmo", "Brest"]


def harbour_log(ships: int) -> tuple[str, dict[str, str]]:
    """A log of `ships` arrivals (at most 64) and each ship's cargo."""
    names = [f"{a} {b}" for a, b in itertools.product(ADJECTIVES, BIRDS)][:ships]
    cargo = {name: CARGO[(5 * i) % len(CARGO)] for i, name in enumerate(names)}
    lines = [
        f"Day {i + 1}: the {name} arrived from {PORTS[(3 * i) % len(PORTS)]} carrying {cargo[name]}."
        for i, name in enumerate(names)
    ]
    return "Harbour log of Port Ellis.\n" + "\n".join(lines) + "\n", cargo


def load_or_fit(directory: Path, reader, agent, args) -> Bridge:
    """The bridge reader -> agent saved under `directory`, or a new one fitted and saved there."""
    (reader_name, reader_model, reader_tok), (agent_name, agent_model, agent_tok) = reader, agent
    path = directory / f"{reader_name}-to-{agent_name}"
    if (path / "bridge.json").exists():
        return Bridge.from_pretrained(path)
    print(f"fitting a bridge {reader_name} -> {agent_name} (saved to {path})")
    bridge = fit_bridge(
        reader_model, agent_model, reader_tok, agent_tok, num_sequences=args.calib_seqs,
        seq_len=args.seq_len, source_name=reader_name, target_name=agent_name, progress=False,
    )  # fmt: skip
    bridge.save_pretrained(path)
    return bridge


@torch.no_grad()
def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description="A reader reads once; agents of other families answer.")
    parser.add_argument("--reader", default="smollm2-135m")
    parser.add_argument("--agents", nargs="+", default=["qwen2.5-coder-0.5b", "gemma3-270m"])
    parser.add_argument("--ships", type=int, default=64, help="entries in the document (at most 64)")
    parser.add_argument("--questions", type=int, default=2, help="questions per agent")
    parser.add_argument("--bridge-dir", type=Path, default=Path("bridges"))
    parser.add_argument("--calib-seqs", type=int, default=32, help="calibration sequences (fitting)")
    parser.add_argument("--seq-len", type=int, default=256, help="tokens per calibration sequence (fitting)")
    args = parser.parse_args(argv)

    document, cargo = harbour_log(args.ships)
    names = list(cargo)
    ships = [names[int((i + 0.5) * len(names) / args.questions)] for i in range(args.questions)]
    reader = (args.reader, *load_model(args.reader))
    agents = [(name, *load_model(name)) for name in args.agents]
    bridges = [load_or_fit(args.bridge_dir, reader, agent, args) for agent in agents]
    for _, model, _ in (reader, *agents):  # warm up: the first forward pages the weights in
        model(torch.tensor([[1, 2, 3]]))

    # The reader reads the document once. Its KV is never modified: every agent bridges it into
    # its own cache space, once, and answers each question from a copy of that cache.
    _, reader_model, reader_tok = reader
    reader_ids = reader_tok(document, return_tensors="pt").input_ids
    start = time.perf_counter()
    reader_kv = capture_kv(reader_model, reader_ids)
    read_s = time.perf_counter() - start
    print(f"\nreader {args.reader} read the document ({reader_ids.shape[1]} tokens) in {read_s:.2f} s")

    rows, correct = [], 0
    for (name, model, tok), bridge in zip(agents, bridges):
        # What bridging saves: the agent prefilling the document itself (as generate() would).
        own_ids = tok(document, return_tensors="pt").input_ids
        start = time.perf_counter()
        model(own_ids, logits_to_keep=1)
        own_s = time.perf_counter() - start

        # What it costs instead: aligning the two tokenizations and translating every layer.
        start = time.perf_counter()
        alignment, _, context_ids = align_context(bridge, document, reader_tok, tok)
        document_cache = BridgedCache(bridge, reader_kv, model, context_ids, alignment=alignment)
        document_cache.materialize()  # translate every layer now, once for all questions
        bridged_s = time.perf_counter() - start
        pad_id = tok.eos_token_id if tok.pad_token_id is None else tok.pad_token_id
        for ship in ships:
            cache = copy.deepcopy(document_cache)  # generate() appends to the cache it is given
            prompt = f"Question: What did the {ship} carry?\nAnswer: The {ship} carried"
            prompt_ids = tok(prompt, add_special_tokens=False, return_tensors="pt").input_ids
            input_ids = torch.cat([context_ids, prompt_ids], dim=1)
            output = model.generate(
                input_ids, attention_mask=torch.ones_like(input_ids), past_key_values=cache,
                max_new_tokens=4, do_sample=False, pad_token_id=pad_id,
            )  # fmt: skip
            answer = tok.decode(output[0, input_ids.shape[1] :], skip_special_tokens=True).strip()
            right = answer.split(" ")[0].strip(".,").lower() == cargo[ship]
            correct += right
            print(f"  {name:<20} {ship:<16} {answer!r:<24} {'right' if right else f'({cargo[ship]})'}")
        rows.append((name, own_ids.shape[1], own_s, bridged_s))

    print(f"\n{'agent':<20}{'tokens':>8}{'own prefill':>14}{'bridged':>10}  (align + translate)")
    for name, tokens, own_s, bridged_s in rows:
        print(f"{name:<20}{tokens:>8}{own_s:>12.2f} s{bridged_s:>8.2f} s")
    own_total = sum(row[2] for row in rows)
    bridged_total = read_s + sum(row[3] for row in rows)
    saved = own_total - bridged_total
    print(
        f"time saved: {saved:.2f} s = {own_total:.2f} s (every agent reads the document) "
        f"- {bridged_total:.2f} s (the reader reads it once, each agent bridges it)"
    )
    print(f"answers right: {correct}/{len(rows) * len(ships)}")
    return {
        "read_s": read_s,
        "own_prefill_s": {row[0]: row[2] for row in rows},
        "bridged_s": {row[0]: row[3] for row in rows},
        "saved_s": saved,
        "answers": len(rows) * len(ships),
        "correct": correct,
    }


if __name__ == "__main__":
    main()
