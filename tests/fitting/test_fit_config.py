"""FitConfig: one validated object with one set of defaults, taken by fit_bridge and `bridgecache
fit`, recorded in a bridge as its recipe and read back from it (old recipes included)."""

from __future__ import annotations

import dataclasses
import json
import re
import shlex

import pytest
from tiny_models import byte_tokenizer, tiny_model

from bridgecache import Bridge, FitConfig, fit_bridge
from bridgecache.bridge import BridgeFormatError
from bridgecache.bridge.recipe import FitOptionError, RecipeError, field_docs, recipe_command
from bridgecache.cli import _build_parser, main
from bridgecache.cli.fit import fit_config
from bridgecache.fitting import fit as fit_module
from bridgecache.models import zoo
from bridgecache.models.spec import model_spec

BAD = [  # (field, value, what the message expects)
    ("method", "lora", r"one of \('fullhead', 'cachebridge'\)"),
    ("method", None, r"one of \('fullhead', 'cachebridge'\)"),
    ("num_sequences", 1, r"an integer >= 2 \(one sequence is held out"),
    ("num_sequences", 4.0, r"an integer >= 2"),
    ("seq_len", 2, r"an integer >= 3 \(native_head=1 positions are not fitted\)"),
    ("domain", "poetry", r"one of \('prose', 'code', 'mixed'\)"),
    ("seed", -1, r"an integer >= 0"),
    ("heldout_every", 0, r"an integer >= 1"),
    ("layers_k", 0, r"an integer >= 1"),
    ("layer_support", "random", r"one of \('probe', 'depth'\)"),
    ("weighting", "inverse", r"one of \('uniform', 'attention'\)"),
    ("lam", 0, r"a finite number > 0"),
    ("lam", float("nan"), r"a finite number > 0"),
    ("lam", True, r"a finite number > 0"),
    ("key_scale", "double", r"one of \('variance', 'none'\)"),
    ("alignment_policy", "middle", r"one of \('last', 'first', 'mean'\)"),
    ("native_head", -1, r"an integer >= 0"),
    ("boundaries", 0, r"an integer >= 1"),
    ("probe_subset", 0, r"an integer >= 1"),
    ("stats_precision", "fp8", r"one of \('bf16-gemm', 'tf32x3', 'tf32', 'bf16'\)"),
    ("identity_if_same", "yes", r"True or False"),
    ("score_heldout", 1, r"True or False"),
    ("score_sequences", 0, r"an integer >= 1"),
    ("score_sequences", 2.5, r"an integer >= 1"),
    ("text", 42, r"a file or folder path, strings, or a dataset"),
    ("text", [], r"a file or folder path, strings, or a dataset \(text is an empty list"),
    ("text_column", "", r"a column name"),
    ("memory_budget_gb", 0, r"None or a finite number of GiB > 0"),
    ("memory_budget_gb", float("inf"), r"None or a finite number of GiB > 0"),
    ("batch_sequences", 0, r"an integer >= 1"),
    # The bridge file reader's upper bounds (bridgecache.bridge.format): a config that fits loads.
    ("seed", 2**63, r"an integer of at most 9,223,372,036,854,775,807"),
    ("num_sequences", 2**31 + 1, r"an integer of at most 2,147,483,648"),
    ("layers_k", 1025, r"an integer of at most 1,024"),
]


@pytest.mark.parametrize("name,value,expected", BAD)
def test_each_bad_option_is_named_with_its_value_and_what_is_expected(name, value, expected):
    with pytest.raises(FitOptionError, match=rf"^{name} is .*; expected {expected}") as info:
        FitConfig(**{name: value})
    assert info.value.option == name and isinstance(info.value, ValueError)
    assert repr(value) in str(info.value)
    with pytest.raises(FitOptionError, match=rf"^{name} is "):  # replace() checks again
        FitConfig().replace(**{name: value})


def test_every_bad_option_is_covered_and_every_field_documented_once():
    names = [f.name for f in dataclasses.fields(FitConfig)]
    assert {name for name, _, _ in BAD} == set(names)
    assert list(field_docs()) == names  # the CLI's help comes from these entries


def test_the_source_bound_of_layers_k_is_checked_against_the_model():
    spec = model_spec(tiny_model("llama"))  # 3 layers
    FitConfig(layers_k=3).check_against(spec)
    with pytest.raises(FitOptionError, match=r"layers_k is 4; expected at most the source model's 3 layers"):
        FitConfig(layers_k=4).check_against(spec)


def test_the_old_call_form_says_what_to_pass():
    model, tok = tiny_model("llama"), byte_tokenizer()
    with pytest.raises(TypeError, match=r"config is 'fullhead'; expected a FitConfig"):
        fit_bridge(model, model, tok, tok, "fullhead")


# ---------------------------------------------------------------------- one set of defaults


class _Stop(Exception):
    pass


def test_fit_bridge_and_the_command_share_one_default_config(monkeypatch, tmp_path):
    assert FitConfig().method == "fullhead"
    parsed = _build_parser().parse_args(["fit", "--source", "a", "--target", "b", "--out", "x"])
    assert fit_config(parsed) == FitConfig()

    # What fit_bridge uses when given no config: its engine sees FitConfig().
    seen = {}

    def engine(sequences, source_shape, target_shape, config, **kwargs):
        seen["fit_bridge"] = config
        raise _Stop  # before any model runs

    monkeypatch.setattr(fit_module, "fit_layer_maps", engine)
    source, target, tok = tiny_model("llama", seed=1), tiny_model("qwen2", seed=2), byte_tokenizer()
    with pytest.raises(_Stop):
        fit_bridge(source, target, tok, tok, progress=False)

    # What `bridgecache fit` with no fitting flag passes to fit_bridge.
    from bridgecache import fitting

    def fit(source, target, source_tok, target_tok, config, **kwargs):
        seen["command"] = config
        return Bridge.identity(target, target_tok)

    monkeypatch.setattr(fitting, "fit_bridge", fit)
    monkeypatch.setattr(zoo, "load_model", lambda name, **kw: (tiny_model("llama"), byte_tokenizer()))
    argv = ["fit", "--source", "smollm2-135m", "--target", "smollm2-135m", "--out", str(tmp_path / "b")]
    assert main(argv) == 0
    assert seen["command"] == seen["fit_bridge"] == FitConfig()


def test_every_field_has_a_flag_that_sets_it():
    argv = ["fit", "--out", "x", "--method", "cachebridge", "--calib-seqs", "5", "--seq-len", "20"]
    argv += ["--domain", "code", "--seed", "3", "--heldout-every", "2", "--layers-k", "2"]
    argv += ["--layer-support", "depth", "--weighting", "uniform", "--lam", "0.5", "--key-scale", "none"]
    argv += ["--alignment-policy", "mean", "--native-head", "2", "--boundaries", "8", "--probe-subset", "all"]
    argv += ["--stats-precision", "bf16", "--no-identity-if-same", "--no-score-heldout"]
    argv += ["--score-sequences", "all"]
    config = fit_config(_build_parser().parse_args(argv))
    assert config == FitConfig(
        method="cachebridge", num_sequences=5, seq_len=20, domain="code", seed=3, heldout_every=2,
        layers_k=2, layer_support="depth", weighting="uniform", lam=0.5, key_scale="none",
        alignment_policy="mean", native_head=2, boundaries=8, probe_subset=None, stats_precision="bf16",
        identity_if_same=False, score_heldout=False, score_sequences=None,
    )  # fmt: skip
    assert config.label.startswith("method=cachebridge num_sequences=5")


@pytest.mark.parametrize(
    "extra,message",
    [
        (["--heldout-every", "0"], r"--heldout-every is 0; expected an integer >= 1"),
        (["--probe-subset", "0"], r"--probe-subset is 0; expected an integer >= 1"),
        (["--score-sequences", "0"], r"--score-sequences is 0; expected an integer >= 1"),
        (["--seed", "-2"], r"--seed is -2; expected an integer >= 0"),
    ],
)
def test_a_bad_flag_is_named_as_a_flag(tmp_path, capsys, extra, message):
    argv = ["fit", "--source", "smollm2-135m", "--target", "smollm2-135m", "--out", str(tmp_path / "b")]
    assert main([*argv, *extra]) == 2
    assert re.search(message, capsys.readouterr().err)


# ---------------------------------------------------------------------- recipes

ODD = FitConfig(
    method="cachebridge", num_sequences=6, seq_len=40, domain="mixed", seed=7, heldout_every=3, layers_k=1,
    layer_support="depth", weighting="uniform", lam=0.25, key_scale="none", alignment_policy="first",
    native_head=2, boundaries=4, probe_subset=None, stats_precision="tf32", identity_if_same=False,
)  # fmt: skip


@pytest.mark.parametrize("config", [FitConfig(), ODD])
def test_recipe_round_trip(config):
    recipe = json.loads(json.dumps(config.recipe("a", "b")))  # as a bridge file stores it
    assert (recipe["source"], recipe["target"]) == ("a", "b") and "score_heldout" not in recipe
    assert FitConfig.from_recipe(recipe) == config
    # The command a recipe prints makes the same config again.
    words = shlex.split(recipe_command(recipe, out="o"))[1:]
    assert fit_config(_build_parser().parse_args(words)) == config


def test_a_recipe_of_an_older_bridgecache_still_loads():
    # The recipe of the shipped smollm2 bridge (rebuilt at export; no stats_precision yet).
    old = {
        "source": "smollm2-135m", "target": "qwen2.5-coder-0.5b", "method": "fullhead",
        "num_sequences": 64, "seq_len": 256, "domain": "prose", "seed": 0, "heldout_every": 8,
        "layers_k": 4, "layer_support": "probe", "lam": 0.01, "weighting": "uniform",
        "key_scale": "variance", "alignment_policy": "last", "native_head": 1, "boundaries": 32,
        "probe_subset": 16, "identity_if_same": True,
    }  # fmt: skip
    config = FitConfig.from_recipe(old)
    # fitted before stats_precision was recorded: at "tf32x3" (float64 rows), not today's default
    assert config == FitConfig(
        num_sequences=64, layers_k=4, weighting="uniform", alignment_policy="last", stats_precision="tf32x3"
    )
    assert config.recipe(old["source"], old["target"]) == {**old, "stats_precision": "tf32x3"}
    with pytest.raises(RecipeError, match=r"\['evil'\] are not FitConfig fields"):
        FitConfig.from_recipe({**old, "evil": 1})


def test_the_shipped_bridges_recipes_load():
    from bridgecache.bridge import builtin
    from bridgecache.bridge.recipe import recipe_of

    names = builtin.builtin_names()
    # calibration sequences per shipped bridge (the escalation bridge's recipe was sized to fit in
    # half an hour on the shared 2-core CPU: benchmarks/reports/evidence-2026-12-07.md)
    sizes = {
        "qwen2.5-coder-1.5b->qwen2.5-coder-0.5b": 64,
        "smollm2-135m->qwen2.5-coder-0.5b": 64,
        "qwen2.5-coder-0.5b->qwen2.5-coder-1.5b": 32,
    }
    assert set(names) == set(sizes)
    for name in names:
        bridge = Bridge.from_pretrained(f"builtin:{name}")
        config = FitConfig.from_recipe(recipe_of(bridge))
        assert config.method == "fullhead" and config.num_sequences == sizes[name]
        assert f"{bridge.source.name}->{bridge.target.name}" == name  # built-in names, no paths


def test_a_recipe_value_out_of_range_is_a_format_error(tmp_path):
    model = tiny_model("llama")
    bridge = Bridge.identity(model)
    bridge.calibration = {"recipe": {"source": "a", "target": "b", "method": "lora"}}
    bridge.save_pretrained(tmp_path / "b")
    with pytest.raises(BridgeFormatError, match=r"'calibration.recipe.method' is 'lora'.*expected one of"):
        Bridge.from_pretrained(tmp_path / "b")
