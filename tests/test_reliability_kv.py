"""KV files: a checksum catches any flipped byte; every malformed header gets a KVFileError
naming the field and what was expected."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import save_file

from bridgecache.files import current_umask
from bridgecache.kv.source import KVFileError, _kv_digest, load_kv, save_kv


def _kv(layers: int = 2, tokens: int = 5):
    g = torch.Generator().manual_seed(0)
    return [
        (torch.randn(1, 2, tokens, 4, generator=g), torch.randn(1, 2, tokens, 4, generator=g))
        for _ in range(layers)
    ]


def _raw(path, header: dict, layers: int = 2, tokens: int = 5, digest: bool = True):
    """A safetensors file with the given header (a valid checksum added unless digest=False)."""
    tensors = {"position_ids": torch.arange(tokens)[None]}
    for i, (k, v) in enumerate(_kv(layers, tokens)):
        tensors[f"keys.{i}"], tensors[f"values.{i}"] = k, v
    if digest:
        header = {"sha256": _kv_digest(tensors)} | header
    save_file(tensors, str(path), metadata=header)
    return path


def test_roundtrip_is_exact_and_leaves_the_source_alone(tmp_path):
    kv = _kv()
    copies = [(k.clone(), v.clone()) for k, v in kv]
    loaded = load_kv(save_kv(tmp_path / "c.safetensors", kv, note="hello"))
    for (k, v), (k0, v0), k1, v1 in zip(kv, copies, loaded.keys, loaded.values):
        assert torch.equal(k, k0) and torch.equal(v, v0)  # source untouched
        assert torch.equal(k1, k0) and torch.equal(v1, v0)


@pytest.mark.parametrize("offset", [8 + 50, -1, -40])  # inside the tensors, at the very end, near the end
def test_any_flipped_byte_in_the_tensors_is_refused(tmp_path, offset):
    path = save_kv(tmp_path / "c.safetensors", _kv())
    data = bytearray(path.read_bytes())
    header_len = int.from_bytes(data[:8], "little")
    index = 8 + header_len + 50 if offset > 0 else len(data) + offset
    data[index] ^= 0x01
    path.write_bytes(bytes(data))
    with pytest.raises(KVFileError, match="checksum mismatch"):
        load_kv(path)


@pytest.mark.parametrize(
    "header,message",
    [
        (
            {"format": "bridgecache.kv/2", "first_token": "[0, 0]"},
            r"'num_layers' is None; expected a positive",
        ),
        (
            {"format": "bridgecache.kv/2", "num_layers": "abc", "first_token": "[0, 0]"},
            r"'num_layers' is 'abc'",
        ),
        ({"format": "bridgecache.kv/2", "num_layers": "0", "first_token": "[]"}, r"'num_layers' is '0'"),
        (
            {"format": "bridgecache.kv/2", "num_layers": "2"},
            r"'first_token' is None; expected a JSON list of 2",
        ),
        ({"format": "bridgecache.kv/2", "num_layers": "2", "first_token": "[0,"}, r"'first_token' is '\[0,'"),
        (
            {"format": "bridgecache.kv/2", "num_layers": "2", "first_token": "[0]"},
            r"'first_token' is '\[0\]'",
        ),
        ({"format": "bridgecache.kv/2", "num_layers": "2", "first_token": "[0, -1]"}, r"integers >= 0"),
        ({"format": "bridgecache.kv/2", "num_layers": "3", "first_token": "[0, 0, 0]"}, r"lacks tensors"),
        ({"format": "bridgecache.kv/2", "num_layers": "2", "first_token": "[0, 9]"}, r"layer 1 holds rows 9"),
        ({"format": "something/else"}, r"not a bridgecache KV file \(format 'something/else'"),
        ({}, r"not a bridgecache KV file \(format None"),
        ({"format": "bridgecache.kv/1", "num_layers": "2", "first_token": "[0, 0]"}, r"older bridgecache"),
    ],
)
def test_malformed_headers_are_named(tmp_path, header, message):
    path = _raw(tmp_path / "c.safetensors", header)
    with pytest.raises(KVFileError, match=message):
        load_kv(path)


def test_a_missing_checksum_is_named(tmp_path):
    header = {"format": "bridgecache.kv/2", "num_layers": "2", "first_token": "[0, 0]"}
    path = _raw(tmp_path / "c.safetensors", header, digest=False)
    with pytest.raises(KVFileError, match=r"'sha256' is None; expected 64 hex digits"):
        load_kv(path)


def test_reserved_metadata_is_refused_and_files_get_the_umask_mode(tmp_path):
    with pytest.raises(ValueError, match=r"\['format'\] are reserved"):
        save_kv(tmp_path / "c.safetensors", _kv(), format="mine")
    assert not (tmp_path / "c.safetensors").exists()
    path = save_kv(tmp_path / "c.safetensors", _kv())
    assert os.stat(path).st_mode & 0o777 == 0o666 & ~current_umask()


def test_header_is_json_readable_by_others(tmp_path):
    path = save_kv(tmp_path / "c.safetensors", _kv(), model="tiny")
    header = json.loads(path.read_bytes()[8 : 8 + int.from_bytes(path.read_bytes()[:8], "little")])
    assert header["__metadata__"]["model"] == "tiny" and len(header["__metadata__"]["sha256"]) == 64
