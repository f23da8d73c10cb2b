"""Weights of a GGUF file as the float32 tensors transformers' own GGUF loader makes, faster.

`tensor_table(gguf_path, config)` (once, when the zoo builds a model folder) records where each
tensor lies in the file and which parameter it fills. `load_gguf_model(gguf_path, table, config,
dtype)` then maps the file, dequantises each tensor and hands the tensors to transformers'
`from_pretrained(None, config=..., state_dict=...)`. The common block types (Q8_0, Q4_1, Q5_0,
Q4_K, Q6_K) are torch ports of gguf's numpy `dequantize_blocks` (what transformers' loader
calls), the same float32 operations in the same order; other types run gguf's own code over
long runs of blocks. transformers' tensor processor for the architecture then reorders and
offsets them as its loader does. So the tensors are bit-identical to
`from_pretrained(folder, gguf_file=...)`: tests/models/test_zoo_gguf.py checks each type on random
blocks and a whole real model.

Knows GGUF and transformers; nothing about caches or the zoo's layout.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

__all__ = ["dequantize", "load_gguf_model", "tensor_table"]

# Values dequantised per step (1M): the temporaries (4 MB each) stay in the CPU's cache and in memory
# the allocator reuses. Steps of 64M values (256 MB temporaries, each paged in afresh) were 4-6x slower.
_VALUES_PER_RUN = 1 << 20


def dequantize(data: np.ndarray, qtype) -> torch.Tensor:
    """float32 values of one GGUF tensor's raw `data`, bit for bit as `gguf.dequantize` computes them.

    data: the tensor's bytes as the reader maps them, [..., bytes per row] (uint8) for quantised
    types; returns [..., values per row] float32. The common types run as torch ops written
    after gguf's numpy (the same float32 operations in the same order: exact, several times
    faster); any other type goes through gguf's own `dequantize_blocks` over long runs of blocks.
    """
    import gguf
    from gguf.constants import GGML_QUANT_SIZES

    if qtype.name in ("F32", "F16"):  # a view or a cast, nothing to batch
        return torch.from_numpy(np.ascontiguousarray(gguf.dequantize(data, qtype)))
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    blocks = np.ascontiguousarray(data).reshape(-1, type_size)
    shape = (*data.shape[:-1], data.shape[-1] // type_size * block_size)
    torch_blocks = _TORCH_BLOCKS.get(qtype.name)
    if torch_blocks is not None:
        out = torch.empty((blocks.shape[0], block_size), dtype=torch.float32)
        step = max(1, _VALUES_PER_RUN // block_size)
        for start in range(0, blocks.shape[0], step):
            run = torch.from_numpy(blocks[start : start + step])
            torch_blocks(run, out[start : start + step])  # written in place: one pass fewer
        return out.reshape(shape)
    from gguf.quants import _type_traits

    out = np.empty((blocks.shape[0], block_size), dtype=np.float32)
    step = max(1, _VALUES_PER_RUN // block_size)
    for start in range(0, blocks.shape[0], step):
        out[start : start + step] = _type_traits[qtype].dequantize_blocks(blocks[start : start + step])
    return torch.from_numpy(out.reshape(shape))


# Each takes [n_blocks, type_size] uint8 and writes [n_blocks, block_size] float32 into `out`,
# following gguf/quants.py's `dequantize_blocks` of the same name operation for operation.


def _half(blocks: torch.Tensor, start: int) -> torch.Tensor:
    """[n_blocks, 1] float32 of the float16 at byte `start` of each block."""
    return blocks[:, start : start + 2].contiguous().view(torch.float16).to(torch.float32)


def _nibbles(qs: torch.Tensor, width: int) -> torch.Tensor:
    """Low then high nibbles of each run of `width` bytes: [n, k * width] -> [n, 2 * k * width] uint8."""
    n = qs.shape[0]
    runs = qs.reshape(n, -1, 1, width)
    return torch.cat([runs & 0x0F, runs >> 4], dim=2).reshape(n, -1)


def _q8_0(blocks: torch.Tensor, out: torch.Tensor) -> None:
    d = _half(blocks, 0)
    x = blocks[:, 2:].contiguous().view(torch.int8)
    torch.mul(x, d, out=out)  # int8 promoted to float32 exactly: gguf's d * x.astype(float32)


def _q4_1(blocks: torch.Tensor, out: torch.Tensor) -> None:
    d, m = _half(blocks, 0), _half(blocks, 2)
    torch.mul(_nibbles(blocks[:, 4:], 16), d, out=out)
    out.add_(m)  # (d * qs) + m, rounded after each step as numpy does


def _q5_0(blocks: torch.Tensor, out: torch.Tensor) -> None:
    n = blocks.shape[0]
    d = _half(blocks, 0)
    # bit j of the little-endian uint32 qh is bit j % 8 of its byte j // 8 (uint8 math: 4x less memory)
    qh = ((blocks[:, 2:6].reshape(n, 4, 1) >> torch.arange(8, dtype=torch.uint8)) & 1).reshape(n, 32)
    ql = _nibbles(blocks[:, 6:], 16)
    qs = (ql | (qh << 4)).view(torch.int8) - 16
    torch.mul(d, qs, out=out)


def _q4_k_scales(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """gguf's Q4_K.get_scale_min: the 6-bit scales and mins, [n, 8] uint8 each."""
    d, m, m_d = scales[:, :4], scales[:, 4:8], scales[:, 8:]
    sc = torch.cat([d & 0x3F, (m_d & 0x0F) | ((d >> 2) & 0x30)], dim=1)
    mins = torch.cat([m & 0x3F, (m_d >> 4) | ((m >> 2) & 0x30)], dim=1)
    return sc, mins


def _q4_k(blocks: torch.Tensor, out: torch.Tensor) -> None:
    n = blocks.shape[0]
    d, dmin = _half(blocks, 0), _half(blocks, 2)
    sc, m = _q4_k_scales(blocks[:, 4:16])
    d = (d * sc).reshape(n, -1, 1)  # uint8 promoted to float32 exactly
    dm = (dmin * m).reshape(n, -1, 1)
    qs = _nibbles(blocks[:, 16:], 32).reshape(n, -1, 32)
    out = out.view(n, -1, 32)
    torch.mul(qs, d, out=out)
    out.sub_(dm)  # (d * qs) - dm, rounded after each step as numpy does


def _q6_k(blocks: torch.Tensor, out: torch.Tensor) -> None:
    n = blocks.shape[0]
    scales = blocks[:, 192:208].contiguous().view(torch.int8)
    d = _half(blocks, 208)
    d = (d * scales).reshape(n, 16, 1)
    ql = _nibbles(blocks[:, :128], 64).reshape(n, -1, 32)
    qh = blocks[:, 128:192].reshape(n, -1, 1, 32)
    qh = torch.cat([(qh >> s) & 0x03 for s in (0, 2, 4, 6)], dim=2).reshape(n, -1, 32)
    q = (ql | (qh << 4)).view(torch.int8) - 32
    torch.mul(d, q.reshape(n, 16, -1), out=out.view(n, 16, -1))


_TORCH_BLOCKS = {"Q8_0": _q8_0, "Q4_1": _q4_1, "Q5_0": _q5_0, "Q4_K": _q4_k, "Q6_K": _q6_k}


def tensor_table(gguf_path: Path, config) -> dict:
    """Where each of the file's tensors lies and which parameter of `config`'s model it fills.

    Reading a GGUF's header parses every metadata field (for a 150K-token vocabulary, seconds),
    and transformers' name map walks every module (seconds more): both are done once, when the
    zoo converts a model, and the table (JSON-ready) is kept beside the file.
    Returns {"architecture": str, "tensors": [{"name", "parameter", "type", "shape", "offset"}]};
    shape is the raw data's ([..., bytes per row] for quantised types), offset in bytes.
    """
    from gguf import GGUFReader
    from transformers import AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import get_gguf_hf_weights_map

    reader = GGUFReader(str(gguf_path))
    field = reader.fields["general.architecture"]
    architecture = bytes(field.parts[field.data[0]]).decode()
    with torch.device("meta"):  # only the parameter names
        skeleton = AutoModelForCausalLM.from_config(config)
    names = get_gguf_hf_weights_map(skeleton, _processor(architecture, config))
    tensors = [
        {
            "name": t.name,
            "parameter": names.get(t.name),  # None: a tensor the model has no place for
            "type": t.tensor_type.name,
            "shape": list(t.data.shape),
            "offset": int(t.data_offset),
        }
        for t in reader.tensors
    ]
    return {"architecture": architecture, "tensors": tensors}


def load_gguf_model(
    gguf_path: Path, table: dict, config, dtype: torch.dtype, progress: bool = True, **from_pretrained_kwargs
):
    """The causal LM of `config` holding the GGUF's weights in `dtype`.

    table: `tensor_table(gguf_path, config)`; config: the transformers config that
    `from_pretrained(..., gguf_file=...)` derives from the same file; from_pretrained_kwargs go
    to `from_pretrained` (device_map, attn_implementation, ...).
    """
    from transformers import MODEL_FOR_CAUSAL_LM_MAPPING

    # copy-on-write: torch wants a writable array (nothing writes to it; the file is never changed)
    data = np.memmap(gguf_path, dtype=np.uint8, mode="c")
    processor = _processor(table["architecture"], config)
    parsed: dict = {"config": processor.config, "tensors": {}}
    names = {t["name"]: t["parameter"] for t in table["tensors"] if t["parameter"] is not None}
    # One intra-op thread while dequantising: each step is ~10 short ops, each a parallel region
    # whose barrier waits for a descheduled thread on a busy CPU (a 0.5B model: 58.5 s of
    # dequantisation on 2 threads, 7.4 s on 1, load average ~3 on 2 cores). Restored after.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        tensors = _dequantised(data, table, processor, parsed, names, dtype, progress, gguf_path)
    finally:
        torch.set_num_threads(threads)
    model_class = MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]  # the Auto class wants a path
    return model_class.from_pretrained(
        None, config=config, state_dict=tensors, dtype=dtype, **from_pretrained_kwargs
    )


def _dequantised(data, table, processor, parsed, names, dtype, progress, gguf_path) -> dict:
    """{parameter name: tensor in `dtype`} of every tensor the model has a place for."""
    from gguf.constants import GGMLQuantizationType
    from tqdm.auto import tqdm

    tensors = {}
    for entry in tqdm(
        table["tensors"], desc=f"reading {Path(gguf_path).name}", disable=not progress, leave=False
    ):
        qtype = GGMLQuantizationType[entry["type"]]
        raw = _raw(data, entry, qtype)
        result = processor.process(
            weights=dequantize(raw, qtype).numpy(),  # the processors work in numpy
            name=entry["name"],
            tensor_key_mapping=names,
            parsed_parameters=parsed,
        )
        if result.name in names:
            tensors[names[result.name]] = torch.from_numpy(np.ascontiguousarray(result.weights)).to(dtype)
    return tensors


def _raw(data: np.ndarray, entry: dict, qtype) -> np.ndarray:
    """The tensor's bytes viewed as gguf's reader does: [..., bytes per row] uint8, or F32/F16."""
    shape = tuple(entry["shape"])
    item = {"F32": np.float32, "F16": np.float16}.get(qtype.name, np.uint8)
    count = int(np.prod(shape))
    return data[entry["offset"] : entry["offset"] + count * np.dtype(item).itemsize].view(item).reshape(shape)


def _processor(architecture: str, config):
    """transformers' tensor processor of the architecture (renames, q/k reorders, norm offsets)."""
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor

    return TENSOR_PROCESSORS.get(architecture, TensorProcessor)(config=config.to_dict())
