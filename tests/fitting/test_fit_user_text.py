"""Fitting on the user's own text: files, folders, strings and datasets (duck-typed) windowed alike,
recorded by the digest of the documents read (never the text), and refused clearly when short or
malformed; the built-in "mixed" text fills with code once the prose runs out."""

from __future__ import annotations

import hashlib

import pytest
import torch
from tiny_models import byte_tokenizer, tiny_model

from bridgecache import Bridge
from bridgecache.bridge.recipe import FitOptionError, recipe_command
from bridgecache.cli import main
from bridgecache.fitting import FitConfig, fit_bridge
from bridgecache.fitting.calibration import calibration_sequences
from bridgecache.text import builtin_windows

pytestmark = pytest.mark.usefixtures("one_thread")

DOCS = [f"Document {i}: " + " ".join(f"word{i}x{j}" for j in range(60)) for i in range(4)]
SMALL = dict(num_sequences=3, seq_len=24, layers_k=1, heldout_every=3, score_heldout=False)


@pytest.fixture(scope="module")
def pair():
    return tiny_model("llama", seed=0), tiny_model("llama", seed=1), byte_tokenizer()


def _digest(docs) -> str:
    h = hashlib.sha256()
    for doc in docs:
        data = doc.encode()
        h.update(len(data).to_bytes(8, "little") + data)
    return "sha256:" + h.hexdigest()


class DuckDataset:
    """What fitting reads of a Hugging Face Dataset: column_names and rows as mappings."""

    def __init__(self, rows):
        self.rows, self.column_names = rows, list(rows[0])

    def __iter__(self):
        return iter(self.rows)


def _maps(bridge) -> list[torch.Tensor]:
    return [t for layer in bridge.layers for t in (layer.key_weight, layer.value_weight, layer.key_bias)]


def test_strings_files_folders_and_datasets_give_one_fit_recorded_by_digest(pair, tmp_path):
    source, target, tok = pair
    folder = tmp_path / "texts"
    folder.mkdir()
    for i, doc in enumerate(DOCS):
        (folder / f"{i}.txt").write_text(doc)
    (folder / "notes.bin").write_bytes(b"\x00ignored")  # only .txt / .md are read from a folder
    forms = {
        "strings": DOCS,
        "folder": folder,
        "files": [folder / f"{i}.txt" for i in range(4)],
        "dataset": DuckDataset([{"id": i, "body": d} for i, d in enumerate(DOCS)]),
        "iterable dataset": (row for row in [{"body": d} for d in DOCS]),  # no column_names: streamed
    }
    fits = {}
    for name, text in forms.items():
        column = "body" if "dataset" in name else "text"
        fits[name] = fit_bridge(source, target, tok, tok, FitConfig(text=text, text_column=column, **SMALL))
    first = fits["strings"]
    calib = first.calibration
    read = calib["text_documents"]
    assert calib["text"] == "user" and 1 <= read <= len(DOCS)
    assert calib["text_sha256"] == _digest(DOCS[:read]) == calib["recipe"]["text"]
    assert all(d not in str(calib) for d in DOCS)  # the text itself is never recorded
    for name, bridge in fits.items():
        assert bridge.calibration["text_sha256"] == calib["text_sha256"], name
        for a, b in zip(_maps(bridge), _maps(first)):
            assert torch.equal(a, b), name
    # A saved bridge loads; its recipe names the text by digest, and fitting from it asks for the text.
    first.save_pretrained(tmp_path / "b")
    recipe = Bridge.from_pretrained(tmp_path / "b").calibration["recipe"]
    again = FitConfig.from_recipe(recipe)
    assert again.text_needed == calib["text_sha256"]
    assert f"--text {calib['text_sha256']}" in recipe_command(recipe)
    with pytest.raises(ValueError, match=r"names its calibration text by digest only \(sha256:"):
        fit_bridge(source, target, tok, tok, again)
    # Other text: another digest.
    other = fit_bridge(source, target, tok, tok, FitConfig(text=DOCS[::-1], **SMALL))
    assert other.calibration["text_sha256"] != calib["text_sha256"]


def test_text_across_tokenizers(pair):
    source, target, tok = pair
    bridge = fit_bridge(source, target, tok, byte_tokenizer(extra="word"), FitConfig(text=DOCS, **SMALL))
    assert bridge.alignment_policy == "last" and bridge.calibration["text"] == "user"


@pytest.mark.parametrize(
    "text,column,message",
    [
        (["only a little text"], "text", r"holds only 0 windows of 24 tokens, asked for 3"),
        (DuckDataset([{"body": "x"}]), "text", r"'text' is not a column .*\(columns: \['body'\]\)"),
        ([{"text": "x"}], "text", r"text holds dict .*expected only strings or only paths"),
        ("/no/such/file.txt", "text", r"text file /no/such/file.txt does not exist"),
    ],
)  # fmt: skip
def test_bad_text_is_named(pair, text, column, message):
    source, target, tok = pair
    with pytest.raises((FitOptionError, ValueError), match=message):
        fit_bridge(source, target, tok, tok, FitConfig(text=text, text_column=column, **SMALL))


def test_a_dataset_row_without_the_column_is_named(pair):
    source, target, tok = pair
    rows = (row for row in [{"text": DOCS[0]}, {"body": "no text here"}])
    with pytest.raises(ValueError, match=r"dataset row 1 has no column 'text'"):
        fit_bridge(source, target, tok, tok, FitConfig(text=rows, **dict(SMALL, num_sequences=40)))


def test_domain_is_for_the_built_in_text_only():
    with pytest.raises(FitOptionError, match=r"^domain is 'code'; expected the default with text="):
        FitConfig(text=DOCS, domain="code")


def test_cli_text_files(tmp_path, capsys):
    paths = []
    for seed in (0, 1):
        path = tmp_path / f"llama-{seed}"
        tiny_model("llama", seed=seed).save_pretrained(path)
        byte_tokenizer().save_pretrained(path)
        paths.append(str(path))
    files = []
    for i, doc in enumerate(DOCS):
        files.append(tmp_path / f"doc{i}.txt")
        files[-1].write_text(doc)
    out = tmp_path / "b"
    argv = ["fit", "--source", paths[0], "--target", paths[1], "--out", str(out), "--calib-seqs", "3"]
    argv += ["--seq-len", "24", "--layers-k", "1", "--heldout-every", "3", "--text", *map(str, files)]
    assert main(argv) == 0
    calib = Bridge.from_pretrained(out).calibration
    assert calib["text"] == "user" and calib["text_sha256"].startswith("sha256:")
    capsys.readouterr()
    # Beyond the models' window (512 positions): refused once they load, before any forward.
    assert main([*argv, "--seq-len", "600", "--force"]) == 2
    assert "--seq-len is 600; expected at most" in capsys.readouterr().err


def test_mixed_fills_with_code_once_the_prose_runs_out():
    tok = byte_tokenizer()
    seq_len = 60_000  # bytes: the prose/calib text holds only a few windows this long
    prose = sum(1 for _ in builtin_windows(tok, seq_len, "prose", "calib", 0))
    with pytest.raises(
        ValueError, match=rf"holds only {prose} windows .*the 'code' \(or 'mixed'\) text holds more"
    ):
        calibration_sequences(tok, tok, 2 * prose + 2, seq_len, "prose")
    seqs, _ = calibration_sequences(tok, tok, 2 * prose + 2, seq_len, "mixed", native_head=0)
    assert len(seqs) == 2 * prose + 2 and all(s.target_ids.numel() == seq_len for s in seqs)
    code = builtin_windows(tok, seq_len, "code", "calib", 0)
    assert torch.equal(seqs[1].target_ids, torch.tensor(next(code)))  # prose, code, prose, code, ...
