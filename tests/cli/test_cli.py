"""The `bridgecache` command on tiny models: demo warm-up and short contexts, bridge cache keys."""

from __future__ import annotations

import pytest
import torch
from tiny_models import tiny_model

from bridgecache import FitConfig, cli, fitting
from bridgecache.bridge.maps import Bridge
from bridgecache.cli import demo
from bridgecache.models import zoo


def _byte_tokenizer():
    """A byte-level fast tokenizer (one token per byte, no BOS; pad id 0), built offline."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {c: i + 1 for i, c in enumerate(alphabet)} | {"<pad>": 0, "<s>": 257, "</s>": 258}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>")


@pytest.fixture
def tiny_zoo(monkeypatch):
    """load_model(name) -> one tiny Qwen2 and a byte tokenizer; records each target forward's length."""
    model, tok = tiny_model("qwen2"), _byte_tokenizer()
    lengths = []
    model.register_forward_pre_hook(
        lambda _, args, kwargs: lengths.append((kwargs.get("input_ids") if not args else args[0]).shape[1]),
        with_kwargs=True,
    )
    monkeypatch.setattr(zoo, "load_model", lambda name: (model, tok))
    return model, tok, lengths


def test_demo_runs_both_paths_once_before_timing_them(tiny_zoo, tmp_path, capsys):
    model, tok, lengths = tiny_zoo
    Bridge.identity(model, tok).save_pretrained(tmp_path / "bridge")
    context, question = "The ship lost its mast near the rocks. ", "What did the ship lose?"
    argv = [
        "demo",
        "--bridge",
        str(tmp_path / "bridge"),
        "--source",
        "smollm2-135m",
        "--target",
        "smollm2-135m",
    ]
    assert cli.main([*argv, "--context", context, "--question", question, "--max-new-tokens", "3"]) == 0
    prompt = f"\nQuestion: {question}\nAnswer:"
    document = tok(context + prompt, return_tensors="pt")["input_ids"].shape[1]
    warm_up = tok(demo._WARM_UP + prompt, return_tensors="pt")["input_ids"].shape[1]
    # the target reads a short warm-up text before the document's timed prefill, which runs once
    assert lengths.count(document) == 1
    assert warm_up in lengths[: lengths.index(document)]
    out = capsys.readouterr().out
    assert "first calls on a short warm-up text" in out and "time-to-first-token ratio" in out


def test_demo_runs_on_a_one_token_context(tiny_zoo, tmp_path, capsys):
    model, tok, _ = tiny_zoo
    Bridge.identity(model, tok).save_pretrained(tmp_path / "bridge")
    argv = [
        "demo",
        "--bridge",
        str(tmp_path / "bridge"),
        "--source",
        "smollm2-135m",
        "--target",
        "smollm2-135m",
    ]
    assert cli.main([*argv, "--context", "H", "--question", "Q?", "--max-new-tokens", "2"]) == 0
    assert "context tokens: 0 translated" in capsys.readouterr().out


def test_bridge_for_keys_its_cache_on_the_fit_settings(monkeypatch, tmp_path):
    monkeypatch.setenv("BRIDGECACHE_HOME", str(tmp_path))
    model, tok = tiny_model("llama"), _byte_tokenizer()
    fits = []

    def fit(source, target, source_tok, target_tok, config, **kwargs):
        fits.append(config)
        return Bridge.identity(target, target_tok, native_head=config.native_head)

    monkeypatch.setattr(fitting, "fit_bridge", fit)
    monkeypatch.setattr(zoo, "load_tokenizer", lambda name: tok)
    first = cli.bridge_for("a", "b", FitConfig(method="fullhead", native_head=2), model, model)
    again = cli.bridge_for(
        "a", "b", FitConfig(method="fullhead", native_head=2), model, model, progress=False
    )
    other = cli.bridge_for("a", "b", FitConfig(method="fullhead", native_head=3), model, model)
    assert len(fits) == 2  # the second call was served from the cache, the third was not
    assert (first.native_head, again.native_head, other.native_head) == (2, 2, 3)


def test_a_damaged_cached_bridge_is_set_aside_and_fitted_again(monkeypatch, tmp_path):
    """A bridge in bridges/ that no longer loads (cut short, edited) does not break every later
    call: it is renamed aside with a warning and fitted again."""
    from bridgecache.files import DamagedFileWarning

    monkeypatch.setenv("BRIDGECACHE_HOME", str(tmp_path))
    model, tok = tiny_model("llama"), _byte_tokenizer()
    fits = []

    def fit(source, target, source_tok, target_tok, config, **kwargs):
        fits.append(config)
        return Bridge.identity(target, target_tok)

    monkeypatch.setattr(fitting, "fit_bridge", fit)
    monkeypatch.setattr(zoo, "load_tokenizer", lambda name: tok)
    cli.bridge_for("a", "b", FitConfig(method="fullhead"), model, model)
    folder = tmp_path / "bridges" / "a-to-b-fullhead"
    (folder / "bridge.json").write_text("[]")  # parses, wrong shape
    with pytest.warns(DamagedFileWarning, match="a-to-b-fullhead was damaged"):
        again = cli.bridge_for("a", "b", FitConfig(method="fullhead"), model, model)
    assert len(fits) == 2 and again.method == "identity"
    assert [p.name.split(".bad-")[0] for p in (tmp_path / "bridges").glob("*.bad-*")] == ["a-to-b-fullhead"]
    cli.bridge_for("a", "b", FitConfig(method="fullhead"), model, model)  # the new one loads
    assert len(fits) == 2


def test_handoff_keeps_a_pad_id_of_0(monkeypatch):
    from bridgecache.runtime.entry.handoff import handoff

    model, tok = tiny_model("qwen2"), _byte_tokenizer()
    assert tok.pad_token_id == 0
    seen = {}
    original = model.generate
    monkeypatch.setattr(model, "generate", lambda **kw: seen.update(kw) or original(**kw))
    handoff(
        Bridge.identity(model),
        model,
        model,
        "Hello",
        source_tokenizer=tok,
        target_tokenizer=tok,
        max_new_tokens=1,
    )
    assert seen["pad_token_id"] == 0
    assert torch.is_tensor(seen["input_ids"])
