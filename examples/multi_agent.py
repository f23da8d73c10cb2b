"""One agent reads, the others answer: a reader model reads a long document once, and answering
agents of other families answer questions from its KV cache, bridged into theirs, instead of each
reading the document themselves.

    python examples/multi_agent.py                  # SmolLM2 reads; Qwen2.5 and Gemma 3 answer
    python examples/multi_agent.py --reader smollm2-135m --agents qwen2.5-coder-0.5b gemma3-270m \\
        --ships 64 --bridge-dir bridges

The document is a harbour log (--ships entries); each question asks what one ship carried and is
one request to one agent. The reader reads the document once; for each question, `handoff` gives
the agent a cache translated from the reader's KV, of which the reader's attention from the
question picks the 20% the agent recomputes itself (`HandoffConfig`'s default). Without bridging,
the agent reads the document and the question itself. Bridges are loaded from
--bridge-dir/<reader>-to-<agent>, or fitted once and saved there. Prints every answer both ways,
then the time saved against every agent reading the document itself.
"""

from __future__ import annotations

import argparse
import itertools
import time
from pathlib import Path

import torch

from bridgecache import Bridge, FitConfig, capture_kv, fit_bridge, handoff, load_model

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
    config = FitConfig(num_sequences=args.calib_seqs, seq_len=args.seq_len)
    bridge = fit_bridge(
        reader_model, agent_model, reader_tok, agent_tok, config, source_name=reader_name,
        target_name=agent_name, progress=False,
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

    # The reader reads the document once. Its KV is never modified: each question hands it to an
    # agent, translated into that agent's cache space.
    _, reader_model, reader_tok = reader
    reader_ids = reader_tok(document, return_tensors="pt").input_ids
    start = time.perf_counter()
    reader_kv = capture_kv(reader_model, reader_ids)
    read_s = time.perf_counter() - start
    print(f"\nreader {args.reader} read the document ({reader_ids.shape[1]} tokens) in {read_s:.2f} s")

    rows, correct = [], 0
    for (name, model, tok), bridge in zip(agents, bridges):
        pad_id = tok.eos_token_id if tok.pad_token_id is None else tok.pad_token_id
        own_s = bridged_s = 0.0
        for ship in ships:
            prompt = f"Question: What did the {ship} carry?\nAnswer: The {ship} carried"
            # Without bridging: the agent reads the document and the question itself.
            ids = tok(document + prompt, return_tensors="pt").input_ids
            start = time.perf_counter()
            output = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=4,
                do_sample=False,
                pad_token_id=pad_id,
            )
            own_s += time.perf_counter() - start
            own = tok.decode(output[0, ids.shape[1] :], skip_special_tokens=True).strip()
            # Bridged: the reader reads the question over its KV (choosing what the agent
            # recomputes), the agent's cache is translated from it, and the agent reads the question.
            start = time.perf_counter()
            result = handoff(
                bridge, reader_model, model, document, prompt, source_tokenizer=reader_tok,
                target_tokenizer=tok, source_kv=reader_kv, max_new_tokens=4, do_sample=False,
            )  # fmt: skip
            bridged_s += time.perf_counter() - start
            answer = result.text.strip()
            right = answer.split(" ")[0].strip(".,").lower() == cargo[ship]
            correct += right
            verdict = "right" if right else f"({cargo[ship]})"
            print(f"  {name:<20} {ship:<16} bridged {answer!r:<22} {verdict:<10} own {own!r}")
        rows.append((name, ids.shape[1], own_s, bridged_s))

    print(f"\n{'agent':<20}{'tokens':>8}{'own reading':>14}{'bridged':>10}  ({len(ships)} questions each)")
    for name, tokens, own_s, bridged_s in rows:
        print(f"{name:<20}{tokens:>8}{own_s:>12.2f} s{bridged_s:>8.2f} s")
    own_total = sum(row[2] for row in rows)
    bridged_total = read_s + sum(row[3] for row in rows)
    saved = own_total - bridged_total
    print(
        f"time saved: {saved:.2f} s = {own_total:.2f} s (every agent reads the document for every question) "
        f"- {bridged_total:.2f} s (the reader reads it once, each question is handed over)"
    )
    print(f"answers right: {correct}/{len(rows) * len(ships)}")
    return {
        "read_s": read_s,
        "own_s": {row[0]: row[2] for row in rows},
        "bridged_s": {row[0]: row[3] for row in rows},
        "saved_s": saved,
        "answers": len(rows) * len(ships),
        "correct": correct,
    }


if __name__ == "__main__":
    main()
