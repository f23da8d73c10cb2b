"""Many handoffs at once with Accelerate: requests split across processes, models across GPUs.

    accelerate launch --num_processes 2 examples/accelerate_multi_gpu.py \\
        --source qwen2.5-coder-1.5b --target qwen2.5-coder-0.5b --bridge bridges/q15-q05
    accelerate launch --num_processes 1 examples/accelerate_multi_gpu.py --random-config qwen2.5
    accelerate launch --multi_gpu --num_processes 2 examples/accelerate_multi_gpu.py \
        --random-config tiny --tokenizer smollm2-135m            # no GPU: two CPU processes (gloo)

Each process takes its share of the requests (`PartialState().split_between_processes`) and of the
GPUs: the source sits on the first of its GPUs and the target is spread over all of them with
device_map="auto". With several GPUs per process the target's layers sit on several devices, and
each translated layer lands on the device of its own target layer. A process answers its requests
in batches of --batch-size, sorted by length so a batch holds contexts of similar lengths
(`bridgecache.handoff_batch` with the default `HandoffConfig`: the source reads the batch's
contexts in one forward pass and the prompt in one more, choosing each row's 20% of tokens that
the target recomputes; one BridgedCache translates every row; the target answers them in one
generate(), whose first forward also recomputes the chosen tokens). Then, on the same devices and
batches, the target reads the contexts and the prompt itself (batched prefill) and generates the
same number of tokens: the native reference. The main process gathers the results and prints the
handoffs per second of each process and of all, beside the native requests per second.

--bridge DIR loads the bridge saved there; if there is none, the main process fits one and saves
it there first. --random-config builds random-weight Qwen2-style models at the shapes of a preset
(no download, e.g. on a machine without network), tokenized by --tokenizer.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch
from accelerate import PartialState
from accelerate.utils import gather_object
from transformers import AutoModelForCausalLM, Qwen2Config

from bridgecache import (
    Bridge,
    FitConfig,
    HandoffConfig,
    fit_bridge,
    handoff_batch,
    load_model,
    load_tokenizer,
)
from bridgecache.runtime.entry.batch import left_pad
from bridgecache.runtime.entry.handoff import context_ids, pad_token_id, prompt_ids
from bridgecache.text import text_chunks

PROMPT = "\n\nIn one sentence, the text above is about"

# (source, target) shapes; rope of Qwen2.5, vocabulary of the tokenizer.
RANDOM_CONFIGS = {
    "qwen2.5": (  # Qwen2.5-1.5B -> Qwen2.5-0.5B
        dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12),
        dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14),
    ),
    "tiny": (
        dict(hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4),
        dict(hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=2),
    ),
}


def random_models(preset: str, tokenizer_name: str, directory: Path, dtype, device) -> list[str]:
    """Save random-weight source and target models of `preset` (with the tokenizer); their paths."""
    tokenizer = load_tokenizer(tokenizer_name)
    paths = []
    for seed, (role, shape) in enumerate(zip(("source", "target"), RANDOM_CONFIGS[preset])):
        path = directory / f"{preset}-{role}"
        if not (path / "config.json").exists():
            config = Qwen2Config(
                vocab_size=len(tokenizer), num_key_value_heads=2, max_position_embeddings=32768,
                rope_parameters={"rope_type": "default", "rope_theta": 1e6}, tie_word_embeddings=True,
                **shape,
            )  # fmt: skip
            torch.manual_seed(seed)
            with torch.device(device):  # initialised where it runs: seconds on a GPU for 1.5B weights
                AutoModelForCausalLM.from_config(config, dtype=dtype).save_pretrained(path)
            tokenizer.save_pretrained(path)
        paths.append(str(path))
    return paths


def placement(state: PartialState) -> tuple[str, dict | None]:
    """(source device, max_memory for the target's device_map="auto") over this process's GPUs."""
    if state.device.type != "cuda":
        return "cpu", None
    per_process = max(1, torch.cuda.device_count() // state.num_processes)
    first = state.local_process_index * per_process % torch.cuda.device_count()
    gpus = range(first, first + per_process)
    return f"cuda:{first}", {gpu: int(0.8 * torch.cuda.mem_get_info(gpu)[0]) for gpu in gpus}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Handoff requests spread over processes and GPUs.")
    parser.add_argument("--source", default="qwen2.5-coder-1.5b")
    parser.add_argument("--target", default="qwen2.5-coder-0.5b")
    parser.add_argument("--random-config", choices=sorted(RANDOM_CONFIGS), help="random weights, no download")
    parser.add_argument("--tokenizer", default="qwen2.5-coder-0.5b", help="of the random models")
    parser.add_argument("--bridge", type=Path, help="bridge directory (default: WORKDIR/bridge)")
    parser.add_argument("--workdir", type=Path, default=Path(tempfile.gettempdir()) / "bridgecache-example")
    parser.add_argument("--calib-seqs", type=int, default=32, help="calibration sequences (fitting)")
    parser.add_argument("--seq-len", type=int, default=256, help="tokens per calibration sequence (fitting)")
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--context-chars", type=int, default=2000, help="characters of each context")
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--batch-size", type=int, default=16, help="contexts per handoff_batch call")
    args = parser.parse_args(argv)

    state = PartialState(cpu=not torch.cuda.is_available())  # CPU processes (gloo) without a GPU
    dtype = torch.bfloat16 if state.device.type == "cuda" else torch.float32
    source_name, target_name = args.source, args.target
    if args.random_config:
        with state.main_process_first():  # the main process writes them, the others then read them
            source_name, target_name = random_models(
                args.random_config, args.tokenizer, args.workdir, dtype, state.device
            )

    source_device, target_memory = placement(state)
    source, source_tok = load_model(source_name, dtype=dtype, device=source_device)
    if target_memory is None:
        target, target_tok = load_model(target_name, dtype=dtype, device=source_device)
    else:
        target, target_tok = load_model(target_name, dtype=dtype, device_map="auto", max_memory=target_memory)
    layer_devices = [next(layer.parameters()).device for layer in target.model.layers]

    bridge_dir = args.bridge or args.workdir / "bridge"
    with state.main_process_first():
        if not (bridge_dir / "bridge.json").exists():
            config = FitConfig(num_sequences=args.calib_seqs, seq_len=args.seq_len)
            fitted = fit_bridge(source, target, source_tok, target_tok, config, progress=False)
            fitted.save_pretrained(bridge_dir)
        bridge = Bridge.from_pretrained(bridge_dir)

    # Exactly --max-new-tokens per request on both paths, so that they do the same work.
    gen = dict(max_new_tokens=args.max_new_tokens, min_new_tokens=args.max_new_tokens, do_sample=False)
    config = HandoffConfig()  # the defaults: 20% of each context refreshed, chosen by the source

    def answer(contexts: list[str]):
        return handoff_batch(
            bridge, source, target, contexts, PROMPT, source_tokenizer=source_tok,
            target_tokenizer=target_tok, config=config, **gen,
        )  # fmt: skip

    prompt = prompt_ids(target_tok, PROMPT)
    pad_id = pad_token_id(target_tok)
    target_device = target.get_input_embeddings().weight.device

    def native(contexts: list[str]):  # the target reads each context and the prompt itself
        rows = [torch.cat([context_ids(target_tok, text), prompt], dim=1) for text in contexts]
        ids, mask = left_pad(rows, pad_id=pad_id if pad_id is not None else 0)
        ids, mask = ids.to(target_device), mask.to(target_device)
        return target.generate(input_ids=ids, attention_mask=mask, pad_token_id=pad_id, **gen)

    def timed(fn, batches) -> float:
        state.wait_for_everyone()
        start = time.perf_counter()
        for batch in batches:
            fn(batch)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        return time.perf_counter() - start

    requests = list(enumerate(text_chunks("prose", "eval", args.requests, chars=args.context_chars)))
    results = []
    with state.split_between_processes(requests) as mine:
        lengths = {index: len(target_tok(context).input_ids) for index, context in mine}
        mine = sorted(mine, key=lambda request: lengths[request[0]])  # similar lengths per batch
        batches = [mine[i : i + args.batch_size] for i in range(0, len(mine), args.batch_size)]
        if batches:  # warm-up: first-call costs (kernel compilation, allocator) untimed
            answer([context for _, context in batches[0]])
            native([context for _, context in batches[0]])

        def handoffs(batch):
            result = answer([context for _, context in batch])
            on_own_device = all(
                layer.keys.device == device for layer, device in zip(result.cache.layers, layer_devices)
            )
            for row, (index, _) in enumerate(batch):
                results.append(
                    dict(request=index, text=result.texts[row], new_tokens=result.output_ids.shape[1],
                         on_own_device=on_own_device, context_tokens=lengths[index])
                )  # fmt: skip

        seconds = timed(handoffs, batches)
        native_seconds = timed(lambda batch: native([context for _, context in batch]), batches)

    devices = [str(d) for d in layer_devices]
    split = ", ".join(f"{devices.count(d)} on {d}" for d in dict.fromkeys(devices))
    processes = gather_object(
        [dict(process=state.process_index, requests=len(results), seconds=seconds, native=native_seconds,
              source=source_device, target=split)]
    )  # fmt: skip
    results = gather_object(results)
    if state.is_main_process:
        report(state, args, bridge, processes, results)
    state.wait_for_everyone()
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        # before the interpreter exits: a process group torn down at exit while the other process
        # is already gone can abort the process ("terminate called without an active exception")
        torch.distributed.destroy_process_group()


def report(state, args, bridge, processes, results) -> None:
    """The main process's printout of what every process measured."""
    print(f"{state.num_processes} processes, {len(results)} requests, bridge {bridge.source.name} -> "
          f"{bridge.target.name} ({bridge.method})")  # fmt: skip
    rate = lambda n, seconds: n / seconds if seconds else 0.0  # noqa: E731
    for p in processes:
        n = p["requests"]
        print(f"process {p['process']}: source on {p['source']}, target layers {p['target']}; "
              f"{n} requests in {p['seconds']:.2f} s ({rate(n, p['seconds']):.2f} handoffs/s; native "
              f"batched prefill {p['native']:.2f} s, {rate(n, p['native']):.2f} requests/s)")  # fmt: skip
    wall = max(p["seconds"] for p in processes)
    native_wall = max(p["native"] for p in processes)
    tokens = sum(r["new_tokens"] for r in results)
    print(f"all: {len(results)} handoffs in {wall:.2f} s ({rate(len(results), wall):.2f} handoffs/s, "
          f"{rate(tokens, wall):.1f} new tokens/s); native batched prefill: {native_wall:.2f} s "
          f"({rate(len(results), native_wall):.2f} requests/s); handoff / native throughput "
          f"{rate(native_wall, wall):.2f}x")  # fmt: skip
    print(f"context: {sum(r['context_tokens'] for r in results) / len(results):.0f} target tokens "
          f"per request on average; {args.max_new_tokens} new tokens each; batches of up to "
          f"{args.batch_size}")  # fmt: skip
    on_device = sum(r["on_own_device"] for r in results)
    print(f"translated layers on their target layer's device: {on_device}/{len(results)} requests")
    print(f"request 0 answered: {sorted(results, key=lambda r: r['request'])[0]['text']!r}")


if __name__ == "__main__":
    main()
