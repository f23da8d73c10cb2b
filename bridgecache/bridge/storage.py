"""A bridge directory on disk: written atomically, read and checked field by field.

Files: `bridge.json` (metadata, per-tensor shape/dtype/sha256, and `tensors_file`: the name of
the tensors file) + `bridge-<16 hex>.safetensors` (the tensors; `bridge.safetensors` in bridges
written before format 2) + `README.md` (the card). A save writes a new tensors file beside the old
one and then replaces `bridge.json` in one rename: the pointer moves last, so a reader, a crash or
a second writer leaves the old bridge or the new one, never half. A bridge saved into a folder
that does not exist yet is built in a hidden staging folder beside it and renamed into place:
a kill leaves no folder at all, never tensors without bridge.json. Loading validates everything
against the metadata and names the field that is wrong. No pickle.

Knows the file layout; the `Bridge` it writes and reads is bridgecache.bridge.maps's.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import math
import os
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file

from bridgecache.bridge.card import render_card
from bridgecache.bridge.format import (
    MAX_JSON_BYTES,
    TENSORS_FILE,
    BridgeFormatError,
    check_bridge_json,
    printable,
)
from bridgecache.files import clean_leftovers, directory_lock, publish, staging_folder
from bridgecache.untrusted import all_finite, shown

__all__ = ["FORMAT_VERSION", "FIELDS", "write", "read", "layer_fields", "check_layer_shapes", "tensors_path"]

FORMAT_VERSION = 2  # 2: bridge.json names its tensors file (`tensors_file`); 1 is still read
_JSON, _TENSORS = "bridge.json", "bridge.safetensors"  # _TENSORS: the name format 1 used
_CARD = "README.md"
FIELDS = ("inputs", "key_weight", "key_bias", "value_weight", "value_bias")


def write(bridge, directory: str | Path, overwrite: bool = True) -> Path:
    """Write the bridge (tensors, bridge.json, README.md card) into `directory` (created if needed).

    Atomic as a whole: a new tensors file is written under its own name, then bridge.json,
    which names it, replaces the old one in one rename; a crash at any point leaves the old
    bridge (or none) loadable and the next save or load removes what it left. Concurrent
    writers leave one of their bridges. Other files in `directory` are kept; files get the
    umask's mode. overwrite=False refuses (FileExistsError) to replace a bridge already in
    `directory`, also against a writer that creates one meanwhile (exactly one wins).
    """
    directory = Path(directory)
    if directory.exists() and not directory.is_dir():
        raise NotADirectoryError(f"{directory} exists and is not a directory")
    if not overwrite and (directory / _JSON).exists():  # early; checked again at the commit
        raise FileExistsError(f"{directory} already holds a bridge; refusing to overwrite it")
    tensors, described = {}, {}
    for i, layer in enumerate(bridge.layers):
        named = {name: getattr(layer, name) for name in FIELDS}
        for name, t in named.items():
            t = t.detach().cpu().contiguous()
            tensors[f"layers.{i}.{name}"] = t
            described[f"layers.{i}.{name}"] = {
                "shape": list(t.shape),
                "dtype": str(t.dtype).removeprefix("torch."),
                "sha256": _tensor_sha(t),
            }
    digest = hashlib.sha256(json.dumps(described, sort_keys=True).encode()).hexdigest()[:16]
    tensors_file = f"bridge-{digest}.safetensors"  # named by content: writers never collide
    meta = {
        "format": "bridgecache.bridge",
        "format_version": FORMAT_VERSION,
        "tensors_file": tensors_file,
        "source": bridge.source.to_dict(),
        "target": bridge.target.to_dict(),
        "method": bridge.method,
        "alignment_policy": bridge.alignment_policy,
        "native_head": bridge.native_head,
        "calibration": bridge.calibration,
        "layers": [
            {
                "source_layers": list(layer.source_layers),
                "inputs": layer.inputs.tolist(),
                "r2_key": _json_float(layer.r2_key),
                "r2_value": _json_float(layer.r2_value),
            }
            for layer in bridge.layers
        ],
        "tensors": described,
    }
    if bridge.fingerprints:
        meta["fingerprints"] = dict(bridge.fingerprints)
    files = (tensors, render_card(bridge), meta)
    if not directory.exists() and _write_new_folder(directory, tensors_file, files, overwrite):
        return directory
    directory.mkdir(parents=True, exist_ok=True)  # a bridge into a folder that exists
    clean_leftovers(directory)
    with staging_folder(directory) as staging:
        tensors_tmp, card_tmp, json_tmp = _stage(staging, tensors_file, files)
        with directory_lock(directory):  # the commit: short, one writer at a time
            if not overwrite and (directory / _JSON).exists():
                raise FileExistsError(
                    f"{directory} already holds a bridge (another writer saved one meanwhile); "
                    "refusing to overwrite it"
                )
            publish(tensors_tmp, directory / tensors_file)
            publish(card_tmp, directory / _CARD)
            publish(json_tmp, directory / _JSON, exclusive=not overwrite)  # the pointer moves last
            _remove_unreferenced(directory, keep=tensors_file)
    return directory


def tensors_path(directory: str | Path) -> Path:
    """The tensors file that `directory`'s bridge.json names (bridge.safetensors before format 2)."""
    directory = Path(directory)
    meta = _read_json(directory / _JSON)
    return directory / meta.get("tensors_file", _TENSORS)


def _read_files(directory: Path) -> tuple[dict, dict[str, torch.Tensor]]:
    """bridge.json and the tensors it names. A writer may replace the bridge between the two
    reads and remove the old tensors, even between the opens inside `_read_tensors` (and a later
    writer may bring the same content-named file back), so any failure to read the tensors is
    retried from bridge.json: tensors files are renamed into place whole, so a damaged one fails
    every time and a concurrently replaced one does not."""
    failure: Exception | None = None
    for _ in range(5):
        meta = _read_json(directory / _JSON)
        path = directory / meta.get("tensors_file", _TENSORS)
        try:
            return meta, _read_tensors(path, set(meta["tensors"]))
        except (FileNotFoundError, BridgeFormatError) as err:
            failure = err
    if isinstance(failure, BridgeFormatError):
        raise failure
    raise BridgeFormatError(f"no bridge tensors at {path} (named by {directory / _JSON})") from failure


def _read_json(path: Path) -> dict:
    if not path.is_file():
        raise BridgeFormatError(f"no bridge metadata at {path} (is this a bridge directory?)")
    size = path.stat().st_size
    if size > MAX_JSON_BYTES:
        raise BridgeFormatError(
            f"{path} has {size:,} bytes; a bridge's metadata has at most {MAX_JSON_BYTES:,}"
        )
    try:
        meta = json.loads(path.read_bytes())
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as err:
        raise BridgeFormatError(
            f"{path} is not valid JSON (truncated or corrupted?): {printable(str(err), 200)}"
        ) from err
    if not isinstance(meta, dict) or meta.get("format") != "bridgecache.bridge":
        raise BridgeFormatError(f"{path}: field 'format' is not 'bridgecache.bridge'")
    if meta.get("format_version") not in (1, FORMAT_VERSION):
        raise BridgeFormatError(
            f"{path}: field 'format_version' is {printable(repr(meta.get('format_version')), 60)}; "
            f"this bridgecache reads 1 and {FORMAT_VERSION}"
        )
    check_bridge_json(meta, path)
    return meta


def _read_tensors(path: Path, described: set[str]) -> dict[str, torch.Tensor]:
    """The tensors of `path` (FileNotFoundError if it is gone; BridgeFormatError if unreadable).
    Its header is bounded by, and its tensor names must be, those bridge.json describes, before
    any tensor is built (a file of a million empty tensors costs nothing)."""
    if not path.exists():
        raise FileNotFoundError(path)
    try:
        with open(path, "rb") as f:
            header_bytes = int.from_bytes(f.read(8), "little")
        limit = 512 * len(described) + 65536  # a tensor's entry takes ~150 bytes
        if header_bytes > limit:
            raise BridgeFormatError(
                f"{path}: its header has {header_bytes:,} bytes; {len(described)} tensors need "
                f"at most {limit:,}"
            )
        with safe_open(str(path), framework="pt") as f:
            names = set(f.keys())
        if names != described:
            missing, extra = sorted(described - names), sorted(names - described)
            raise BridgeFormatError(
                f"{path}: tensors {shown(missing, 120)} are missing and {len(extra)} are not described "
                f"by bridge.json (e.g. {shown(extra[:3], 120)})"
            )
        return load_file(str(path))
    except BridgeFormatError:
        raise
    except (SafetensorError, OSError, ValueError, RuntimeError) as err:
        if isinstance(err, FileNotFoundError) or not path.exists():  # removed by a writer meanwhile
            raise FileNotFoundError(path) from err
        raise BridgeFormatError(
            f"{path} is not a readable safetensors file (truncated or corrupted?): {printable(str(err), 200)}"
        ) from err


def _tidy(directory: Path, meta: dict) -> None:
    """Remove what killed writers left in a bridge directory (best effort: it may be read-only).
    Folders others manage (the package's built-in bridges, a Hub cache snapshot) are left alone."""
    from bridgecache.bridge.builtin import builtin_root

    resolved = directory.resolve()
    if resolved.parent.name == "snapshots" or resolved.is_relative_to(builtin_root()):
        return
    clean_leftovers(directory)
    with contextlib.suppress(OSError, BridgeFormatError), directory_lock(directory, blocking=False) as locked:
        if locked and _read_json(directory / _JSON) == meta:  # still the bridge just read
            _remove_unreferenced(directory, meta.get("tensors_file", _TENSORS))


def _remove_unreferenced(directory: Path, keep: str) -> None:
    """Delete tensors files of replaced bridges (the caller holds the directory lock)."""
    for path in directory.iterdir():
        if path.name != keep and TENSORS_FILE.fullmatch(path.name):
            with contextlib.suppress(OSError):
                path.unlink()


def _tensors_name(meta: dict, directory: Path) -> Path:
    return directory / meta.get("tensors_file", _TENSORS)


def _check_tensors(meta: dict, tensors: dict[str, torch.Tensor], directory: Path) -> None:
    """Every described tensor exists with its shape, dtype and sha256, and holds finite numbers
    (a NaN or Inf in a map turns every translated row into NaN); nothing extra."""
    described = meta["tensors"]
    expected_names = {f"layers.{i}.{name}" for i in range(len(meta["layers"])) for name in FIELDS}
    if set(described) != expected_names:
        raise BridgeFormatError(
            f"{directory / _JSON}: field 'tensors' does not list one set of maps per layer"
        )
    for name in sorted(expected_names):
        if name not in tensors:
            raise BridgeFormatError(f"{_tensors_name(meta, directory)}: tensor {name!r} is missing")
        t, want = tensors[name], described[name]
        if list(t.shape) != want["shape"]:
            raise BridgeFormatError(
                f"tensor {name!r}: shape {list(t.shape)} but {_JSON} says {want['shape']}"
            )
        if str(t.dtype).removeprefix("torch.") != want["dtype"]:
            raise BridgeFormatError(f"tensor {name!r}: dtype {t.dtype} but {_JSON} says {want['dtype']}")
        if _tensor_sha(t) != want["sha256"]:
            raise BridgeFormatError(
                f"tensor {name!r}: checksum mismatch (the file was modified or corrupted)"
            )
        if t.is_floating_point() and not all_finite(t):
            bad = int((~torch.isfinite(t)).sum())
            raise BridgeFormatError(
                f"{_tensors_name(meta, directory)}: tensor {name!r} holds {bad} NaN or infinite "
                "values; expected finite numbers (a map with them turns every translated row into NaN)"
            )
    extra = sorted(set(tensors) - expected_names)
    if extra:
        raise BridgeFormatError(
            f"{_tensors_name(meta, directory)}: {len(extra)} unexpected tensors, e.g. "
            f"{printable(repr(extra[:3]), 200)}"
        )


def read(directory: Path) -> tuple[dict, dict[str, torch.Tensor]]:
    """(bridge.json's metadata, the tensors) of a bridge directory, every field and tensor checked
    (BridgeFormatError names what is wrong); leftovers of killed writers removed."""
    meta, tensors = _read_files(directory)
    _tidy(directory, meta)
    _check_tensors(meta, tensors, directory)
    return meta, tensors


def _stage(staging: Path, tensors_file: str, files) -> tuple[Path, Path, Path]:
    """Write the tensors, the card and bridge.json into `staging`; returns their paths."""
    tensors, card, meta = files
    tensors_tmp, card_tmp, json_tmp = staging / tensors_file, staging / _CARD, staging / _JSON
    save_file(tensors, str(tensors_tmp))
    card_tmp.write_text(card)
    json_tmp.write_text(json.dumps(meta, indent=1))
    return tensors_tmp, card_tmp, json_tmp


def _write_new_folder(directory: Path, tensors_file: str, files, overwrite: bool) -> bool:
    """A bridge into a folder that does not exist yet: the whole folder is built in a staging
    folder beside it and renamed into place in one step, so a kill at any moment leaves no
    `directory` at all (never one holding tensors without bridge.json); what a killed writer
    leaves in the parent is a hidden staging folder, removed by the next save there. False when
    another writer created `directory` meanwhile (then the caller writes into it)."""
    parent = directory.parent
    parent.mkdir(parents=True, exist_ok=True)
    clean_leftovers(parent)
    with staging_folder(parent) as staging:
        folder = staging / "bridge"
        folder.mkdir()  # mode 0777 minus the umask, as the folder would have had
        for tmp in _stage(staging, tensors_file, files):
            publish(tmp, folder / tmp.name)
        with directory_lock(parent):  # the commit: one rename
            if directory.exists():
                if not overwrite and (directory / _JSON).exists():
                    raise FileExistsError(
                        f"{directory} already holds a bridge (another writer saved one meanwhile); "
                        "refusing to overwrite it"
                    )
                return False
            try:
                os.rename(folder, directory)
            except OSError as err:  # created meanwhile by a writer that does not take this lock
                if err.errno in (errno.EEXIST, errno.ENOTEMPTY, errno.EISDIR):
                    return False
                raise
    _fsync_folder(parent)
    return True


def _fsync_folder(directory: Path) -> None:
    with contextlib.suppress(OSError):  # some filesystems refuse fsync on a folder
        fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def layer_fields(meta: dict, tensors: dict, directory: Path, device) -> list[dict]:
    """Per target layer, the `LayerMap` fields: the maps as float32 (inputs int64) on `device`,
    the source layers and held-out R^2 from bridge.json, which must agree with the tensors."""
    fields = []
    for i, entry in enumerate(meta["layers"]):
        where = f"{directory / _JSON}: layers[{i}]"
        t = {name: _as_fp32(tensors[f"layers.{i}.{name}"]).to(device) for name in FIELDS}
        if t["inputs"].tolist() != _get(entry, "inputs", where):
            raise BridgeFormatError(
                f"{directory}: layers.{i}.inputs differs between {_JSON} and its tensors file"
            )
        fields.append(
            dict(
                source_layers=[int(s) for s in _get(entry, "source_layers", where)],
                r2_key=_from_json_float(_get(entry, "r2_key", where)),
                r2_value=_from_json_float(_get(entry, "r2_value", where)),
                **t,
            )
        )
    return fields


def check_layer_shapes(bridge, directory: Path) -> None:
    """The maps' shapes agree with the source and target specs."""
    src, tgt = bridge.source, bridge.target
    for i, layer in enumerate(bridge.layers):
        heads, n_in = layer.inputs.shape[:2]
        expected = {
            "inputs": (tgt.num_kv_heads, n_in, 2),
            "key_weight": (tgt.num_kv_heads, n_in * src.head_dim, tgt.head_dim),
            "value_weight": (tgt.num_kv_heads, n_in * src.head_dim, tgt.head_dim),
            "key_bias": (tgt.num_kv_heads, tgt.head_dim),
            "value_bias": (tgt.num_kv_heads, tgt.head_dim),
        }
        for name, shape in expected.items():
            got = tuple(getattr(layer, name).shape)
            if got != shape:
                raise BridgeFormatError(
                    f"{directory}: layers.{i}.{name} has shape {got}; the specs imply {shape}"
                )
        for name in FIELDS[1:]:
            if getattr(layer, name).dtype != torch.float32:
                raise BridgeFormatError(
                    f"{directory}: layers.{i}.{name} is {getattr(layer, name).dtype}, not float32"
                )
        src_layer, src_head = layer.inputs[..., 0], layer.inputs[..., 1]
        if heads and (int(src_layer.min()) < 0 or int(src_layer.max()) >= src.num_layers):
            raise BridgeFormatError(
                f"{directory}: layers.{i}.inputs names a source layer outside the source model"
            )
        if heads and (int(src_head.min()) < 0 or int(src_head.max()) >= src.num_kv_heads):
            raise BridgeFormatError(
                f"{directory}: layers.{i}.inputs names a source head outside the source model"
            )
        if sorted(set(src_layer.flatten().tolist())) != sorted(layer.source_layers):
            raise BridgeFormatError(f"{directory}: layers.{i}.source_layers disagrees with layers.{i}.inputs")


def _as_fp32(t: torch.Tensor) -> torch.Tensor:
    # Shipped bridges store their maps in float16/bfloat16; the maps are applied in float32.
    return t.float() if t.dtype in (torch.float16, torch.bfloat16) else t


def _get(entry, key: str, where: str):
    if not isinstance(entry, dict) or key not in entry:
        raise BridgeFormatError(f"{where}: field {key!r} is missing")
    return entry[key]


def _tensor_sha(t: torch.Tensor) -> str:
    # Hash the raw bytes (any dtype) through a uint8 view; 16 hex digits suffice to catch corruption.
    raw = t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    return hashlib.sha256(raw).hexdigest()[:16]


def _json_float(x: float) -> float | None:
    return None if math.isnan(x) else float(x)


def _from_json_float(x) -> float:
    return math.nan if x is None else float(x)
