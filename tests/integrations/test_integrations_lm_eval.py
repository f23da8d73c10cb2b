"""lm-evaluation-harness's "bridgecache" model (bridgecache.integrations.lm_eval) on the local tasks
of tests/integrations/lm_eval_task/ (facts.jsonl, offline):
- its loglikelihoods equal `bridgecache eval`'s (evaluation.evaluate) on the same items read as
  ppl items (the whole lm_eval context bridged, the choice scored after it), request by request,
  and so do its choices; through a random bridge (the bridge is used), a bridge fitted across two
  tokenizers, and the real shipped smollm2-135m -> qwen2.5-coder-0.5b bridge;
- through an identity bridge, generate_until is the target's own greedy reply cut at the stop
  string, and loglikelihood_rolling and an empty context are the target's own plain forward;
- `python -m bridgecache.integrations.lm_eval --model bridgecache` finds the model by name;
- bad arguments fail before a model loads, sampling is refused.
lm_eval is imported through `require_engine`: where .ci/run installed it, a broken install fails.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import require_engine
from tiny_models import byte_tokenizer, random_bridge, tiny_model

lm_eval = require_engine("lm_eval")
from lm_eval.api.instance import Instance  # noqa: E402
from lm_eval.tasks import TaskManager  # noqa: E402

from bridgecache import HandoffConfig  # noqa: E402
from bridgecache.bridge.maps import Bridge  # noqa: E402
from bridgecache.evaluation import PplItem, Variant, evaluate  # noqa: E402
from bridgecache.integrations.lm_eval import BridgecacheLM  # noqa: E402

TASKS = Path(__file__).with_name("lm_eval_task")
CHOICE, GENERATE = "bridgecache_facts_choice", "bridgecache_facts_generate"
DOCS = [json.loads(line) for line in (TASKS / "facts.jsonl").read_text().splitlines()]

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def tok():
    return byte_tokenizer()


@pytest.fixture(scope="module")
def llama():
    # peaked predictions (as tests/evaluation/test_evaluation.py); room for ~500-byte contexts
    return tiny_model("llama", vocab_size=258, initializer_range=0.3, max_position_embeddings=1024)


def _run(lm, task: str, limit: int | None = None) -> list[dict]:
    """lm_eval's logged samples of `task`, in document order."""
    out = lm_eval.simple_evaluate(
        model=lm,
        tasks=[task],
        task_manager=TaskManager(include_path=str(TASKS), include_defaults=False),  # no 30 s index
        limit=limit,
        bootstrap_iters=0,
        log_samples=True,
    )
    return sorted(out["samples"][task], key=lambda s: s["doc_id"])


def _context(doc: dict) -> str:
    return f"{doc['context']}\nQuestion: {doc['question']}\nAnswer:"


def _eval_scores(source, source_tok, target, target_tok, bridge, docs) -> tuple[list, list]:
    """`bridgecache eval`'s (bridged, native) (log p, tokens) of every (doc, choice), as ppl items."""
    items = [PplItem(_context(doc), " " + choice) for doc in docs for choice in doc["choices"]]
    variant = Variant(bridge, HandoffConfig())
    ev = evaluate(source, source_tok, target, target_tok, items, "ppl", [variant], progress=False)
    assert [r.index for r in ev.items] == list(range(len(items)))
    bridged = [r.scores[f"bridged[{variant.name}]"][0] for r in ev.items]
    return bridged, [r.scores["native"][0] for r in ev.items]


def _requests(sample: dict) -> list[tuple]:
    """A logged sample's request arguments (a list of tuples in Python, a dict in the samples file)."""
    arguments = sample["arguments"]
    if isinstance(arguments, dict):
        return [(a["arg_0"], a["arg_1"]) for a in arguments.values()]
    return [tuple(a) for a in arguments]


def _check_agreement(samples: list[dict], docs: list[dict], bridged: list) -> None:
    """Request by request, lm_eval's loglikelihood is evaluate()'s bridged one; the picks agree."""
    flat = iter(bridged)
    for sample, doc in zip(samples, docs):
        assert _requests(sample) == [(_context(doc), " " + choice) for choice in doc["choices"]]
        expected = [next(flat)[0] for _ in doc["choices"]]
        got = [float(resp[0][0]) for resp in sample["resps"]]
        assert got == pytest.approx(expected, abs=2e-3)
        pick = max(range(len(expected)), key=expected.__getitem__)
        assert sample["acc"] == float(pick == doc["answer"])


def test_choice_scores_equal_bridgecache_evals_through_a_random_bridge(llama, tok):
    bridge = random_bridge(llama)
    lm = BridgecacheLM(bridge, llama, llama, source_tokenizer=tok, target_tokenizer=tok)
    samples = _run(lm, CHOICE, limit=3)
    assert [s["doc_id"] for s in samples] == [0, 1, 2]
    bridged, native = _eval_scores(llama, tok, llama, tok, bridge, DOCS[:3])
    _check_agreement(samples, DOCS[:3], bridged)
    # the bridge is what was read: the target's own reading scores otherwise
    assert max(abs(b[0] - n[0]) for b, n in zip(bridged, native)) > 0.1


def test_choice_scores_equal_bridgecache_evals_across_tokenizers(llama, tok):
    """A fitted bridge onto a target whose vocabulary reads "Answer" as one token (tokenalign's path)."""
    from bridgecache import FitConfig, fit_bridge

    target_tok = byte_tokenizer(extra="Answer")
    target = tiny_model("qwen2", vocab_size=259, initializer_range=0.3, max_position_embeddings=1024)
    text = [doc["context"] for doc in DOCS]
    small = dict(num_sequences=3, seq_len=24, layers_k=1, heldout_every=3, score_heldout=False)
    bridge = fit_bridge(llama, target, tok, target_tok, FitConfig(text=text, **small))
    assert bridge.alignment_policy == "last"  # aligned across tokenizers, not read as one
    lm = BridgecacheLM(bridge, llama, target, source_tokenizer=tok, target_tokenizer=target_tok)
    samples = _run(lm, CHOICE, limit=2)
    bridged, _ = _eval_scores(llama, tok, target, target_tok, bridge, DOCS[:2])
    _check_agreement(samples, DOCS[:2], bridged)
    assert len(target_tok(_context(DOCS[0]))["input_ids"]) < len(tok(_context(DOCS[0]))["input_ids"])


def test_identity_generation_is_the_targets_own_greedy_reply(llama, tok):
    lm = BridgecacheLM(Bridge.identity(llama), llama, llama, source_tokenizer=tok, target_tokenizer=tok)
    samples = _run(lm, GENERATE, limit=2)
    for sample, doc in zip(samples, DOCS):
        ids = tok(_context(doc), return_tensors="pt")["input_ids"]
        with torch.no_grad():
            out = llama.generate(ids, max_new_tokens=8, do_sample=False, pad_token_id=tok.eos_token_id)
        expected = tok.decode(out[0, ids.shape[1] :], skip_special_tokens=True).split("\n")[0]
        assert sample["resps"] == [[expected]]
        ((context, gen_kwargs),) = _requests(sample)
        assert context == _context(doc) and gen_kwargs["until"] == ["\n"]


def test_identity_rolling_and_empty_context_are_the_targets_own_forward(llama, tok):
    lm = BridgecacheLM(Bridge.identity(llama), llama, llama, source_tokenizer=tok, target_tokenizer=tok)
    text = DOCS[0]["context"][:200]
    ids = [tok.bos_token_id] + tok(text, add_special_tokens=False)["input_ids"]
    with torch.no_grad():
        logprobs = torch.log_softmax(llama(torch.tensor([ids])).logits[0].float(), -1)
    expected = sum(float(logprobs[t, c]) for t, c in enumerate(ids[1:]))
    rolling = Instance("loglikelihood_rolling", {}, (text,), 0)
    assert lm.loglikelihood_rolling([rolling], disable_tqdm=True) == [pytest.approx(expected, abs=1e-3)]
    empty = Instance("loglikelihood", {}, ("", text), 0)
    ((got, greedy),) = lm.loglikelihood([empty], disable_tqdm=True)
    assert got == pytest.approx(expected, abs=1e-3)
    assert greedy == all(int(logprobs[t].argmax()) == c for t, c in enumerate(ids[1:]))


def test_bad_arguments_fail_before_a_model_loads(llama, tok, tmp_path):
    bridge = Bridge.identity(llama)
    with pytest.raises(ValueError, match="source: 'no-such-model' is neither a built-in name"):
        BridgecacheLM(bridge, "no-such-model", llama, target_tokenizer=tok)
    with pytest.raises(ValueError, match="target: a loaded model needs its tokenizer"):
        BridgecacheLM(bridge, llama, llama, source_tokenizer=tok)
    with pytest.raises(TypeError, match="config=.*expected a HandoffConfig"):
        BridgecacheLM(bridge, llama, llama, source_tokenizer=tok, target_tokenizer=tok, config={"refresh": 0})
    lm = BridgecacheLM(bridge, llama, llama, source_tokenizer=tok, target_tokenizer=tok)
    sampled = Instance("generate_until", {}, ("abc", {"until": ["\n"], "do_sample": True}), 0)
    with pytest.raises(ValueError, match="request 0: .*sampling; the bridgecache model decodes greedily"):
        lm.generate_until([sampled], disable_tqdm=True)
    too_long = Instance("loglikelihood", {}, ("x" * 1100, " y"), 0)  # and " y"'s 2 bytes
    with pytest.raises(ValueError, match="request 0: 1102 target tokens exceed the target's window of 1024"):
        lm.loglikelihood([too_long], disable_tqdm=True)


def test_the_command_line_finds_the_model_by_name(llama, tok, tmp_path):
    """`python -m bridgecache.integrations.lm_eval` is lm_eval's command line with --model bridgecache."""
    model_dir = tmp_path / "tiny"
    llama.save_pretrained(model_dir)
    tok.save_pretrained(model_dir)
    bridge = random_bridge(llama)
    bridge_dir = bridge.save_pretrained(tmp_path / "bridge")
    out = tmp_path / "out"
    args = f"bridge={bridge_dir},source={model_dir},target={model_dir}"
    cmd = [
        sys.executable, "-m", "bridgecache.integrations.lm_eval", "--model", "bridgecache",
        "--model_args", args, "--tasks", CHOICE, "--include_path", str(TASKS), "--limit", "2",
        "--log_samples", "--output_path", str(out),
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_DATASETS_OFFLINE": "1"}
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp_path, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    (samples_file,) = out.rglob(f"samples_{CHOICE}_*.jsonl")
    samples = sorted(map(json.loads, samples_file.read_text().splitlines()), key=lambda s: s["doc_id"])
    bridged, _ = _eval_scores(llama, tok, llama, tok, bridge, DOCS[:2])
    _check_agreement(samples, DOCS[:2], bridged)


@pytest.mark.real_model
def test_lm_eval_agrees_with_bridgecache_eval_on_the_shipped_bridge(smollm2):
    """Item by item on the real smollm2-135m -> qwen2.5-coder-0.5b bridge (across tokenizers); two
    documents (6 requests): evaluate() scores each under five conditions, minutes on a CPU for all."""
    from bridgecache.models.zoo import load_model

    bridge = Bridge.from_pretrained("builtin:smollm2-135m->qwen2.5-coder-0.5b")
    source, source_tok = smollm2
    target, target_tok = load_model("qwen2.5-coder-0.5b")
    lm = BridgecacheLM(bridge, source, target, source_tokenizer=source_tok, target_tokenizer=target_tok)
    samples = _run(lm, CHOICE, limit=2)
    bridged, native = _eval_scores(source, source_tok, target, target_tok, bridge, DOCS[:2])
    assert len(samples) == 2
    _check_agreement(samples, DOCS[:2], bridged)
    assert max(abs(b[0] - n[0]) for b, n in zip(bridged, native)) > 0.01  # a handoff, not a prefill
