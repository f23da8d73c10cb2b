"""Bridges as artifacts: recipes, shipped float16 built-ins, the Hub round trip, the card, inspect.

Everything runs on tiny random models and a byte-level tokenizer; the Hub is never reached
(its cache layout is built in tmp_path and read in offline mode; uploads are intercepted).
"""

from __future__ import annotations

import json
import shutil

import huggingface_hub
import pytest
import torch
from huggingface_hub import constants, metadata_load
from huggingface_hub.file_download import repo_folder_name
from tiny_models import byte_tokenizer, tiny_model

from bridgecache import Bridge, SpecMismatchError, handoff
from bridgecache.bridge import builtin, tensors_path
from bridgecache.bridge.export import export_builtin
from bridgecache.bridge.recipe import RecipeError, infer_recipe, recipe_command, recipe_of
from bridgecache.bridge.summary import feed_matrix
from bridgecache.cli import main
from bridgecache.fitting import FitConfig, fit_bridge
from bridgecache.fitting.refit import refit
from bridgecache.models.zoo import BUILTIN_MODELS, load_model

PAIR = "smollm2-135m->qwen2.5-coder-0.5b"  # zoo names recorded on tiny models: nothing is fetched
FIT = FitConfig(method="cachebridge", num_sequences=4, seq_len=40, heldout_every=2)
_MAPS = ("key_weight", "key_bias", "value_weight", "value_bias")


@pytest.fixture(scope="module")
def pair():
    """(source, target, tokenizer): tiny llama -> tiny qwen2 sharing a byte tokenizer."""
    return tiny_model("llama", seed=1), tiny_model("qwen2", seed=2), byte_tokenizer()


@pytest.fixture(scope="module")
def fitted(pair, tmp_path_factory):
    """A tiny CacheBridge recorded as smollm2-135m -> qwen2.5-coder-0.5b, saved; (bridge, dir)."""
    source, target, tok = pair
    name_s, name_t = PAIR.split("->")
    bridge = fit_bridge(source, target, tok, tok, FIT, source_name=name_s, target_name=name_t, progress=False)
    directory = bridge.save_pretrained(tmp_path_factory.mktemp("fitted") / "bridge")
    return bridge, directory


@pytest.fixture
def shipped_root(tmp_path, monkeypatch):
    """An empty folder standing in for the package's bridgecache/bridges."""
    root = tmp_path / "bridges"
    root.mkdir()
    monkeypatch.setattr(builtin, "builtin_root", lambda: root)
    return root


def _assert_same_maps(a: Bridge, b: Bridge, atol: float = 0.0) -> None:
    assert [x.source_layers for x in a.layers] == [x.source_layers for x in b.layers]
    for x, y in zip(a.layers, b.layers):
        assert torch.equal(x.inputs, y.inputs)
        for name in _MAPS:
            torch.testing.assert_close(getattr(y, name), getattr(x, name), atol=atol, rtol=0)


# ---------------------------------------------------------------------- recipes


def test_refit_from_the_recorded_recipe_gives_the_same_maps(pair, fitted):
    source, target, tok = pair
    bridge, directory = fitted
    recipe = recipe_of(Bridge.from_pretrained(directory))  # through JSON, as shipped
    assert recipe["num_sequences"] == 4 and recipe["seq_len"] == 40 and recipe["heldout_every"] == 2
    assert (recipe["source"], recipe["target"], recipe["method"]) == (*PAIR.split("->"), "cachebridge")
    again = refit(recipe, source, target, tok, tok, progress=False)
    _assert_same_maps(bridge, again)
    assert again.calibration["recipe"] == recipe

    fewer = refit(recipe, source, target, tok, tok, num_sequences=2, progress=False)
    assert fewer.calibration["recipe"]["num_sequences"] == 2  # the override is recorded
    assert not torch.equal(fewer.layers[0].key_weight, bridge.layers[0].key_weight)
    with pytest.raises(RecipeError, match="not recipe entries"):
        refit(recipe, source, target, tok, tok, num_seqs=2)


def test_a_bridge_fitted_before_recipes_ships_with_a_rebuilt_recipe(pair, tmp_path):
    source, target, tok = pair
    # fitted as bridges were before recipes recorded stats_precision: with float64 rows
    name_s, name_t = PAIR.split("->")
    config = FIT.replace(stats_precision="tf32x3")
    bridge = fit_bridge(
        source, target, tok, tok, config, source_name=name_s, target_name=name_t, progress=False
    )
    old = Bridge.from_pretrained(bridge.save_pretrained(tmp_path / "fitted"))
    del old.calibration["recipe"]  # as bridgecache wrote bridges before recipes
    old.save_pretrained(tmp_path / "old")
    shipped = Bridge.from_pretrained(export_builtin(tmp_path / "old", root=tmp_path / "shipped"))
    assert "recipe_rebuilt" in shipped.calibration
    _assert_same_maps(bridge, refit(recipe_of(shipped), source, target, tok, tok, progress=False))
    del old.calibration["key_scale"]
    with pytest.raises(RecipeError, match=r"lacks \['key_scale'\].*fit it again"):
        infer_recipe(old)


def test_the_statistics_precision_is_part_of_the_recipe(fitted):
    bridge, _ = fitted
    assert recipe_of(bridge)["stats_precision"] == "bf16-gemm"  # the default, recorded
    assert "--stats-precision bf16-gemm" in recipe_command(recipe_of(bridge), "out")


def test_recipe_command_names_every_setting_it_needs(fitted):
    command = recipe_command(recipe_of(fitted[0]), out="out")
    assert command.startswith("bridgecache fit --source smollm2-135m --target qwen2.5-coder-0.5b")
    assert "--method cachebridge --calib-seqs 4 --seq-len 40" in command and "--out out" in command
    assert "--heldout-every 2" in command  # every FitConfig field has its option


def test_identity_bridge_has_no_recipe(pair):
    with pytest.raises(RecipeError, match="records no fit recipe"):
        recipe_of(Bridge.identity(pair[1]))


def test_fit_recipe_command_regenerates_a_saved_bridge(pair, tmp_path, capsys):
    source, target, tok = pair
    dirs = {}
    for role, model in (("source", source), ("target", target)):
        dirs[role] = tmp_path / f"tiny-{role}"
        model.save_pretrained(dirs[role])
        tok.save_pretrained(dirs[role])
    # The models as `fit --recipe` loads them by name (sdpa attention; a qwen2 directory's
    # tokenizer gains Qwen's special tokens), so the two fits must agree bit for bit.
    (source, source_tok), (target, target_tok) = (load_model(str(dirs[r])) for r in ("source", "target"))
    names = dict(source_name=str(dirs["source"]), target_name=str(dirs["target"]))
    bridge = fit_bridge(source, target, source_tok, target_tok, FIT, **names, progress=False)
    bridge.save_pretrained(tmp_path / "made")
    assert main(["fit", "--recipe", str(tmp_path / "made"), "--out", str(tmp_path / "again")]) == 0
    assert "recipe of" in capsys.readouterr().out
    _assert_same_maps(bridge, Bridge.from_pretrained(tmp_path / "again"))
    capsys.readouterr()
    assert (
        main(["fit", "--recipe", str(tmp_path / "made"), "--source", "x", "--out", str(tmp_path / "x")]) == 2
    )
    assert "drop --source/--target" in capsys.readouterr().err
    assert main(["fit", "--out", str(tmp_path / "x")]) == 2
    assert "give --source and --target" in capsys.readouterr().err


# ---------------------------------------------------------------------- built-in bridges


def test_export_builtin_float16_round_trip_is_small_and_loads_by_name(fitted, shipped_root, capsys):
    bridge, directory = fitted
    assert main(["export-builtin", str(directory), PAIR]) == 0
    assert "float16" in capsys.readouterr().out
    out = shipped_root / PAIR.replace("->", "--")
    stored = json.loads((out / "bridge.json").read_text())
    assert {stored["tensors"][f"layers.0.{n}"]["dtype"] for n in _MAPS} == {"float16"}
    assert tensors_path(out).stat().st_size < 0.6 * tensors_path(directory).stat().st_size

    assert builtin.builtin_names() == [PAIR]
    loaded = Bridge.from_pretrained(f"builtin:{PAIR}")
    assert all(getattr(layer, n).dtype == torch.float32 for layer in loaded.layers for n in _MAPS)
    for a, b in zip(bridge.layers, loaded.layers):
        for name in _MAPS:
            ref = getattr(a, name)
            err = (getattr(b, name) - ref).abs().max() / ref.abs().max()
            assert 0 < err < 1e-3  # float16 rounding: relative error ~2^-11
    prints = loaded.calibration["fingerprints"]
    assert prints["target"] == {
        "zoo": "qwen2.5-coder-0.5b",
        "gguf": f"sha256:{BUILTIN_MODELS['qwen2.5-coder-0.5b'].sha256}",
        "tokenizer": bridge.target.tokenizer,
    }
    assert loaded.calibration["recipe"] == bridge.calibration["recipe"]  # the recipe ships too

    bf16 = export_builtin(directory, dtype="bfloat16", root=shipped_root.parent / "bf16")
    loaded = Bridge.from_pretrained(bf16)
    err = (loaded.layers[1].value_weight - bridge.layers[1].value_weight).abs().max()
    assert 0 < err < 1e-2 * bridge.layers[1].value_weight.abs().max()


def test_export_refuses_bridges_not_between_zoo_models(pair, tmp_path):
    source, target, tok = pair
    names = dict(source_name="my-llama", target_name="my-qwen")
    bridge = fit_bridge(source, target, tok, tok, FIT, **names, progress=False)
    bridge.save_pretrained(tmp_path / "b")
    with pytest.raises(ValueError, match="'my-llama' is not a zoo model"):
        export_builtin(tmp_path / "b", root=tmp_path)
    with pytest.raises(ValueError, match="cannot be shipped as"):
        export_builtin(tmp_path / "b", "a->b", root=tmp_path)


def test_export_refuses_values_float16_cannot_hold(fitted, tmp_path):
    big = Bridge.from_pretrained(fitted[1])
    big.layers[1].key_bias[0, 3] = 1e5  # above float16's largest finite value (65504)
    big.save_pretrained(tmp_path / "big")
    with pytest.raises(ValueError, match=r"layers.1.key_bias does not fit in float16.*--dtype bfloat16"):
        export_builtin(tmp_path / "big", root=tmp_path / "out")
    assert not (tmp_path / "out").exists()  # nothing half-written
    assert export_builtin(tmp_path / "big", dtype="bfloat16", root=tmp_path / "out").exists()


def test_builtin_names_are_checked(shipped_root):
    with pytest.raises(ValueError, match="expected 'SOURCE->TARGET'"):
        Bridge.from_pretrained("builtin:qwen2.5-coder-0.5b")
    with pytest.raises(FileNotFoundError, match="shipped: none in this installation"):
        Bridge.from_pretrained("builtin:a->b")


def test_builtin_refuses_to_load_when_the_zoo_pins_another_file(fitted, shipped_root, monkeypatch):
    export_builtin(fitted[1], root=shipped_root)
    entry = BUILTIN_MODELS["qwen2.5-coder-0.5b"]
    monkeypatch.setitem(BUILTIN_MODELS, entry.name, type(entry)(**{**vars(entry), "sha256": "0" * 64}))
    with pytest.raises(
        SpecMismatchError, match=r"target model 'qwen2.5-coder-0.5b' from file sha256:1d96.*fit --recipe"
    ):
        Bridge.from_pretrained(f"builtin:{PAIR}")


def test_builtin_refuses_other_models_and_tokenizers(pair, fitted, shipped_root, tmp_path):
    source, target, tok = pair
    bridge = Bridge.from_pretrained(export_builtin(fitted[1], root=shipped_root))
    builtin.check_models(bridge, source, target, tok, tok)  # the models it was fitted on
    other_vocab = byte_tokenizer(extra="<extra>")
    with pytest.raises(SpecMismatchError, match="tokenizer"):
        handoff(bridge, source, target, "some context", source_tokenizer=tok, target_tokenizer=other_vocab)
    with pytest.raises(SpecMismatchError, match="target"):
        builtin.check_models(bridge, target=tiny_model("llama"))

    # A zoo-converted model records the GGUF it came from (the .complete marker).
    converted = tmp_path / "converted"
    target.save_pretrained(converted)
    (converted / ".complete").write_text("f" * 64)
    from transformers import AutoModelForCausalLM

    reloaded = AutoModelForCausalLM.from_pretrained(converted)
    assert builtin.model_fingerprint(reloaded) == "sha256:" + "f" * 64
    with pytest.raises(SpecMismatchError, match="converted from sha256:ffff"):
        builtin.check_models(bridge, target=reloaded, target_tokenizer=tok)
    (converted / ".complete").write_text(BUILTIN_MODELS["qwen2.5-coder-0.5b"].sha256)
    builtin.check_models(bridge, target=AutoModelForCausalLM.from_pretrained(converted), target_tokenizer=tok)


def test_zoo_fingerprints_are_the_pinned_gguf_hashes():
    for name, entry in BUILTIN_MODELS.items():
        assert entry.sha256 and builtin.zoo_fingerprint(name) == f"sha256:{entry.sha256}"


# ---------------------------------------------------------------------- card and Hub


def test_save_pretrained_writes_a_bridge_card(fitted):
    bridge, directory = fitted
    meta = metadata_load(directory / "README.md")  # huggingface_hub's own front-matter reader
    assert (meta["source"], meta["target"], meta["method"]) == (
        "smollm2-135m",
        "qwen2.5-coder-0.5b",
        "cachebridge",
    )
    assert meta["library_name"] == "bridgecache" and meta["parameters"] == bridge.num_parameters()
    assert (
        meta["calibration"]["num_sequences"] == 4
        and meta["calibration"]["rows"] == bridge.calibration["rows"]
    )
    scores = meta["heldout_scores"]
    assert scores["key"] == [round(layer.r2_key, 4) for layer in bridge.layers]
    assert scores["value_mean"] == pytest.approx(sum(layer.r2_value for layer in bridge.layers) / 3, abs=1e-4)
    assert meta["command"] == recipe_command(bridge.calibration["recipe"])
    body = (directory / "README.md").read_text()
    assert "| target layer |" in body and body.count("\n| ") == 3 + 2  # header, 3 layers, mean


def _hub_cache(tmp_path, repo_id: str, files_from, commit: str = "a" * 40):
    """A huggingface_hub cache holding one snapshot of `repo_id` (blobs + symlinks + refs/main)."""
    repo = tmp_path / "hub" / repo_folder_name(repo_id=repo_id, repo_type="model")
    (repo / "blobs").mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    for path in files_from.iterdir():
        blob = repo / "blobs" / f"blob-{path.name}"
        shutil.copy(path, blob)
        (snapshot / path.name).symlink_to(f"../../blobs/{blob.name}")
    return tmp_path / "hub"


def test_hub_id_loads_offline_from_the_hub_cache(fitted, tmp_path, monkeypatch):
    bridge, directory = fitted
    cache = _hub_cache(tmp_path, "someone/tiny-bridge", directory)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    loaded = Bridge.from_pretrained("someone/tiny-bridge", cache_dir=cache)
    _assert_same_maps(bridge, loaded)
    _assert_same_maps(
        bridge, Bridge.from_pretrained("someone/tiny-bridge", cache_dir=cache, revision="a" * 40)
    )
    with pytest.raises(FileNotFoundError, match=r"'someone/tiny-bridge' \(revision v2\).*HF_HUB_OFFLINE"):
        Bridge.from_pretrained("someone/tiny-bridge", cache_dir=cache, revision="v2")
    with pytest.raises(FileNotFoundError, match="'someone/other'"):
        Bridge.from_pretrained("someone/other", cache_dir=cache)


def test_local_files_only_reads_the_cache_and_local_dirs_still_win(fitted, tmp_path, monkeypatch):
    bridge, directory = fitted
    cache = _hub_cache(tmp_path, "someone/tiny-bridge", directory)
    _assert_same_maps(
        bridge, Bridge.from_pretrained("someone/tiny-bridge", cache_dir=cache, local_files_only=True)
    )
    # A relative directory that looks like "org/name" is a directory, not a hub id.
    (tmp_path / "someone").mkdir()
    shutil.copytree(directory, tmp_path / "someone" / "tiny-bridge")
    monkeypatch.chdir(tmp_path)
    _assert_same_maps(bridge, Bridge.from_pretrained("someone/tiny-bridge"))


def test_push_to_hub_uploads_the_files_and_card(fitted, tmp_path, monkeypatch):
    bridge, _ = fitted
    calls = {}

    def create_repo(self, repo_id, **kwargs):
        calls["create"] = (repo_id, kwargs)

    def upload_folder(self, *, repo_id, folder_path, **kwargs):
        calls["upload"] = (repo_id, kwargs)
        shutil.copytree(folder_path, tmp_path / "uploaded")
        url = f"https://huggingface.co/{repo_id}/commit/{'b' * 40}"
        return huggingface_hub.CommitInfo(
            commit_url=url, commit_message="m", commit_description="", oid="b" * 40
        )

    monkeypatch.setattr(huggingface_hub.HfApi, "create_repo", create_repo)
    monkeypatch.setattr(huggingface_hub.HfApi, "upload_folder", upload_folder)
    url = bridge.push_to_hub("someone/tiny-bridge", private=True)
    assert url == f"https://huggingface.co/someone/tiny-bridge/commit/{'b' * 40}"
    assert calls["create"] == (
        "someone/tiny-bridge",
        {"private": True, "exist_ok": True, "repo_type": "model"},
    )
    assert calls["upload"][0] == "someone/tiny-bridge" and calls["upload"][1]["repo_type"] == "model"
    uploaded = tmp_path / "uploaded"
    names = sorted(p.name for p in uploaded.iterdir())
    assert names == sorted(["README.md", "bridge.json", tensors_path(uploaded).name])
    assert calls["upload"][1]["delete_patterns"] == ["bridge*.safetensors"]  # no stale tensors on the Hub
    assert metadata_load(uploaded / "README.md")["heldout_scores"]["key"] == [
        round(layer.r2_key, 4) for layer in bridge.layers
    ]
    _assert_same_maps(bridge, Bridge.from_pretrained(uploaded))


# ---------------------------------------------------------------------- inspect and repr


def test_inspect_prints_the_summary_and_plots(fitted, tmp_path, capsys):
    bridge, directory = fitted
    png = tmp_path / "bridge.png"
    assert main(["inspect", str(directory), "--plot", str(png)]) == 0
    printed = capsys.readouterr().out
    assert repr(bridge) in printed and bridge.summary() in printed
    assert "source  smollm2-135m  (llama, 3 layers, 2 KV heads x 16" in printed
    assert "calibration  4 x 40 tokens of prose" in printed
    assert f"{bridge.num_parameters():,} parameters" in printed and "on disk (float32 tensors)" in printed
    assert "made by bridgecache fit --source smollm2-135m" in printed
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    from matplotlib.image import imread

    assert imread(png).shape[:2] == (400, 1100)  # 11 x 4 inches at 100 dpi


def test_inspect_a_builtin_by_name(fitted, shipped_root, capsys):
    export_builtin(fitted[1], root=shipped_root)
    assert main(["inspect", f"builtin:{PAIR}"]) == 0
    printed = capsys.readouterr().out
    assert "on disk (float16 tensors)" in printed
    assert (
        f"fitted on target qwen2.5-coder-0.5b: file sha256:{BUILTIN_MODELS['qwen2.5-coder-0.5b'].sha256}"
        in printed
    )


def test_repr_and_markdown_and_feeds(fitted):
    bridge, _ = fitted
    text = repr(bridge)
    assert "\n" not in text and text.startswith(
        "Bridge(smollm2-135m -> qwen2.5-coder-0.5b, method=cachebridge"
    )
    assert f"{bridge.num_parameters():,} parameters" in text
    markdown = bridge._repr_markdown_()
    rows = [line for line in markdown.splitlines() if line.startswith("| ")]
    assert len(rows) == 1 + 3 + 1  # header, one per target layer, mean
    feeds = feed_matrix(bridge)
    assert feeds.shape == (3, 3) and torch.allclose(feeds.sum(1), torch.ones(3))
    for t, layer in enumerate(bridge.layers):
        assert set(feeds[t].nonzero().flatten().tolist()) == set(layer.source_layers)
