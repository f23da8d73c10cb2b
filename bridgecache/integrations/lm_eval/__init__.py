"""lm-evaluation-harness's model "bridgecache": every request's context read by the source and
handed to the target through a bridge (the default `HandoffConfig`, as `bridgecache eval`).

    python -m bridgecache.integrations.lm_eval --model bridgecache --tasks NAME [--include_path DIR] \\
        --model_args 'bridge=builtin:smollm2-135m->qwen2.5-coder-0.5b[,source=NAME,target=NAME]'

`python -m bridgecache.integrations.lm_eval` is lm_eval's own command line (the same arguments);
it imports this module first, which registers the model: lm-eval 0.4 finds external models only
once imported (no entry point). In Python: `import bridgecache.integrations.lm_eval`, then
`lm_eval.simple_evaluate(model="bridgecache", model_args=...)`, or pass a `BridgecacheLM` built
from models already loaded. lm_eval is optional: `pip install 'bridgecache[lm_eval]'`.

Requests, as `bridgecache eval` reads a ppl item (context bridged, nothing read natively between
it and the scored text; bridgecache.evaluation.prompts):
    loglikelihood (context, continuation)  the source reads the context; the target gets it as a
        bridged cache (`bridged_prefix`) and scores the continuation after it. Requests with the
        same context share one handoff and are scored as one batch (a multiple-choice item's
        choices). Trailing whitespace of the context moves to the continuation (lm_eval's rule).
    generate_until (context, gen_kwargs)   the same handoff, then the target's greedy reply until a
        stop string (`until`), its EOS or `max_gen_toks` (default 256); greedy only.
    loglikelihood_rolling (text,)          no context to hand off: the target alone over lm_eval's
        rolling windows of its own length, each window's context prefilled by the target.
An empty context (some tasks score a bare continuation) has nothing to hand off either: the
target reads its start token (BOS, else EOS: lm_eval's convention) and the continuation.
The continuation is tokenized on its own (lm_eval's HF model splits a joint tokenization): the
context is a cache boundary, as in every bridgecache path. A request longer than a model's window
is refused (EvaluationError), not cut.

Knows lm_eval's request types and bridgecache's evaluation primitives; no task, metric or file.
"""

from __future__ import annotations

import torch
from tqdm.auto import tqdm

try:
    from lm_eval.api.model import LM
    from lm_eval.api.registry import register_model
    from lm_eval.utils import get_rolling_token_windows, make_disjoint_window
except ImportError as err:  # lm_eval is an optional extra
    raise ImportError(
        f"bridgecache.integrations.lm_eval needs lm-evaluation-harness ({err}): "
        "pip install 'bridgecache[lm_eval]'"
    ) from err

from bridgecache.evaluation.decoding import reply_ids, stop_ids
from bridgecache.evaluation.items import EvaluationError
from bridgecache.evaluation.prompts import Prompts
from bridgecache.evaluation.scoring import Prefix, bridged_prefix, native_prefix
from bridgecache.kv.capture import capture_kv
from bridgecache.runtime.config import HandoffConfig
from bridgecache.runtime.engine import HandoffEngine
from bridgecache.runtime.entry.likelihood import score, score_rows

__all__ = ["BridgecacheLM"]

MAX_GEN_TOKS = 256  # lm_eval's default for generate_until


@register_model("bridgecache")
class BridgecacheLM(LM):
    """An lm_eval `LM` whose contexts reach the target through `bridge` (see the module docstring).

    bridge: a `Bridge`, or what `Bridge.from_pretrained` reads (a directory, "builtin:S->T", a
        hub id).
    source, target: model names for `load_model` (default: the bridge's), or loaded models; with
        loaded models give their tokenizers too.
    config: the `HandoffConfig` (default: the default handoff, as `bridgecache eval`).
    dtype, device: how named models load (float32; CUDA where there is one, else the CPU).
    batch_size, max_batch_size: lm_eval's; unused (requests that share a context form a batch).
    """

    def __init__(
        self,
        bridge,
        source=None,
        target=None,
        *,
        source_tokenizer=None,
        target_tokenizer=None,
        config: HandoffConfig | None = None,
        dtype: str = "float32",
        device: str | None = None,
        batch_size=None,
        max_batch_size=None,
    ) -> None:
        super().__init__()
        from bridgecache.bridge.builtin import check_models
        from bridgecache.bridge.maps import Bridge

        if config is not None and not isinstance(config, HandoffConfig):
            raise TypeError(f"config={config!r}; expected a HandoffConfig or None")
        self.config = config if config is not None else HandoffConfig()
        if isinstance(bridge, str):
            bridge = Bridge.from_pretrained(bridge)
        elif not isinstance(bridge, Bridge):
            raise TypeError(
                f"bridge={bridge!r}; expected a Bridge or a bridge name (a directory, "
                "'builtin:SOURCE->TARGET' or a hub id)"
            )
        self.bridge = bridge
        source = bridge.source.name if source is None else source
        target = bridge.target.name if target is None else target
        _check_names(source, target)  # before a model loads
        self.target, self.target_tok = _model(target, target_tokenizer, "target", dtype, device)
        if isinstance(source, str) and source == target:
            self.source, self.source_tok = self.target, self.target_tok
        else:
            self.source, self.source_tok = _model(source, source_tokenizer, "source", dtype, device)
        check_models(bridge, self.source, self.target, self.source_tok, self.target_tok)
        self.prompts = Prompts(self.source_tok, self.target_tok)
        self.engine = HandoffEngine(bridge, self.source, self.target)
        self.stop = stop_ids(self.target_tok)
        self._device = self.target.get_input_embeddings().weight.device

    # ------------------------------------------------------------------ lm_eval's requests

    @torch.no_grad()
    def loglikelihood(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        """(sum of log p of the continuation, whether greedy decoding yields it) per request."""
        pairs = [_move_space(*_args(request, 2, "loglikelihood")) for request in requests]
        by_context: dict[str, list[int]] = {}
        for k, (context, _) in enumerate(pairs):
            by_context.setdefault(context, []).append(k)
        results: list = [None] * len(pairs)
        for context, members in tqdm(by_context.items(), desc="bridgecache", disable=disable_tqdm):
            rows = [self._continuation(pairs[k][1], k) for k in members]
            prefix = self._prefix(context, max(map(len, rows)), members[0])
            for k, row in zip(members, score_rows(self.target, prefix, rows)):
                results[k] = (row.logprob, row.greedy)
                self.cache_hook.add_partial("loglikelihood", requests[k].args, results[k])
        return results

    @torch.no_grad()
    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """The target's greedy reply after each bridged context, cut at the first stop string."""
        results = []
        for k, request in enumerate(tqdm(requests, desc="bridgecache", disable=disable_tqdm)):
            context, gen_kwargs = _args(request, 2, "generate_until")
            until, max_tokens = _generation_options(gen_kwargs, k)
            prefix = self._prefix(context, max_tokens, k)
            ids = reply_ids(
                self.target, prefix, [], max_tokens, stop=self.stop, tokenizer=self.target_tok, until=until
            )
            text = self.target_tok.decode(ids, skip_special_tokens=True)
            for stop in until:
                text = text.split(stop)[0]
            results.append(text)
            self.cache_hook.add_partial("generate_until", request.args, text)
        return results

    @torch.no_grad()
    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """The whole text's log-likelihood under the target alone (no context to hand off)."""
        window = _window(self.target)
        results = []
        for request in tqdm(requests, desc="bridgecache", disable=disable_tqdm):
            (text,) = _args(request, 1, "loglikelihood_rolling")
            ids = self.target_tok(text, add_special_tokens=False)["input_ids"]
            windows = get_rolling_token_windows(ids, _start(self.target_tok), window, 1)
            total = 0.0
            for context, continuation in map(make_disjoint_window, windows):
                prefix = native_prefix(self.target, torch.tensor([context]))
                total += score(self.target, prefix, [continuation])[0][0]
            results.append(total)
            self.cache_hook.add_partial("loglikelihood_rolling", request.args, total)
        return results

    # ------------------------------------------------------------------ the handoff

    def _prefix(self, text: str, after: int, k: int) -> Prefix:
        """The target's bridged prefix of context `text` (request k; `after` tokens follow it);
        for an empty context, the target's own prefill of its start token (nothing to hand off)."""
        if not text:
            return native_prefix(self.target, torch.tensor([[_start(self.target_tok)]]))
        context = self.prompts.context(text, self.bridge, words=self.config.wants_words)
        for name, model, ids, more in (
            ("target", self.target, context.target_ids, after),
            ("source", self.source, context.source_ids, 0),
        ):
            if ids.shape[1] + more > _window(model):
                raise EvaluationError(
                    f"request {k}: {ids.shape[1] + more} {name} tokens exceed the {name}'s window of "
                    f"{_window(model)}; bridgecache does not cut contexts"
                )
        return bridged_prefix(
            self.bridge,
            capture_kv(self.source, context.source_ids),
            self.target,
            context.target_ids,
            context.alignment,
            config=self.config,
            source_model=self.source,
            prompt_ids=torch.zeros(1, 0, dtype=torch.long),  # the question is inside the context
            words=context.words,
            engine=self.engine,
        )

    def _continuation(self, text: str, k: int) -> list[int]:
        ids = self.target_tok(text, add_special_tokens=False)["input_ids"] if text else []
        if not ids:
            raise EvaluationError(f"request {k}: the continuation {text!r} has no tokens to score")
        return ids

    # ------------------------------------------------------------------ lm_eval's hooks

    @property
    def tokenizer_name(self) -> str:
        """Names the target's tokenizer in lm_eval's request cache."""
        return str(getattr(self.target_tok, "name_or_path", "")).replace("/", "__")


def _check_names(*names) -> None:
    from bridgecache.fitting.options import check_model_reference
    from bridgecache.models.zoo import BUILTIN_MODELS

    for role, name in zip(("source", "target"), names):
        problem = isinstance(name, str) and check_model_reference(name, BUILTIN_MODELS)
        if problem:
            raise ValueError(f"{role}: {problem}")


def _model(name_or_model, tokenizer, role: str, dtype: str, device: str | None):
    """(model, tokenizer): loaded by name, or the caller's model with its tokenizer."""
    if isinstance(name_or_model, str):
        from bridgecache.models.zoo import load_model

        return load_model(name_or_model, dtype=dtype, device=_device(device))
    if tokenizer is None:
        raise ValueError(f"{role}: a loaded model needs its tokenizer ({role}_tokenizer=...)")
    return name_or_model, tokenizer


def _device(device: str | None) -> str:
    """Where named models load: `device`, except that lm_eval's default (cuda:0, passed on every
    machine) or None means the CPU where CUDA is absent, as lm_eval's own HF model does."""
    if device is None or (device.startswith("cuda") and not torch.cuda.is_available()):
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


def _args(request, n: int, kind: str) -> tuple:
    args = tuple(request.args)
    if len(args) != n:
        raise ValueError(f"{kind} request {args!r:.120}: expected {n} arguments, got {len(args)}")
    return args


def _move_space(context: str, continuation: str) -> tuple[str, str]:
    """lm_eval's rule: the context's trailing whitespace belongs to the continuation."""
    kept = context.rstrip()
    return kept, context[len(kept) :] + continuation


def _generation_options(gen_kwargs, k: int) -> tuple[tuple[str, ...], int]:
    """(stop strings, max new tokens) from a generate_until request's gen_kwargs; greedy only."""
    if not isinstance(gen_kwargs, dict):
        raise ValueError(f"generate_until request {k}: gen_kwargs {gen_kwargs!r}; expected a dict")
    if gen_kwargs.get("do_sample") or float(gen_kwargs.get("temperature", 0.0) or 0.0) > 0:
        raise ValueError(
            f"generate_until request {k}: gen_kwargs {gen_kwargs!r} ask for sampling; the bridgecache "
            "model decodes greedily (do_sample=False, temperature=0)"
        )
    until = gen_kwargs.get("until", ())
    until = (until,) if isinstance(until, str) else tuple(until)
    if not all(isinstance(u, str) and u for u in until):
        raise ValueError(f"generate_until request {k}: until={until!r}; expected non-empty strings")
    tokens = gen_kwargs.get("max_gen_toks", MAX_GEN_TOKS)
    if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 1:
        raise ValueError(f"generate_until request {k}: max_gen_toks={tokens!r}; expected an integer >= 1")
    return until, tokens


def _window(model) -> int:
    return int(model.config.get_text_config().max_position_embeddings)


def _start(tokenizer) -> int:
    """BOS, else EOS: what lm_eval's HF model reads before a text with nothing before it (as the
    no-context condition of `bridgecache eval`)."""
    token = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else tokenizer.eos_token_id
    if token is None:
        raise ValueError("the target tokenizer has neither a BOS nor an EOS token to start a bare text")
    return int(token)
