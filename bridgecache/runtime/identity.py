"""Is this still the right model: one full check per engine, one cheap check per request.

    identity = ModelIdentity(bridge, source, target, source_tokenizer, target_tokenizer)  # full
    identity.check()                 # per request, before any work: nothing it was built on changed
    identity.source_fingerprint      # the source's weights, recorded on the KV the engine captures

Built once, with the engine: the full check (`check_models`, bridgecache.bridge.builtin) compares
each model's spec, its tokenizer's vocabulary and its weights' fingerprint
(bridgecache.models.fingerprint) with what the bridge was fitted on. Per request: the
`weights_version` (the library's one definition of "changed") of the tensors the engine's memos
derive from, both models' input embeddings and the target's key-norm weights, compared with the
one taken when it was built: a handful of tensors, no walk of the models. A `BridgedCache` built
without an engine checks its own models once, when its private state is made
(runtime.native_work.plan).

Knows models and bridges; nothing about requests or caches.
"""

from __future__ import annotations

from bridgecache.bridge.builtin import check_models
from bridgecache.models.fingerprint import weight_fingerprint, weights_version

__all__ = ["ModelIdentity"]


class ModelIdentity:
    """The identity of one engine's models (see the module docstring)."""

    def __init__(self, bridge, source, target, source_tokenizer=None, target_tokenizer=None):
        check_models(bridge, source, target, source_tokenizer, target_tokenizer)
        self.source_fingerprint = None if source is None else weight_fingerprint(source)
        self._models = (source, target)
        # the target's key norms, found once (their weights are read at each check: one replaced
        # by a new Parameter is seen too)
        modules = () if target is None else target.modules()
        norms = [getattr(m, "k_norm", None) for m in modules if hasattr(m, "layer_idx")]
        self._norms = [n for n in norms if n is not None]
        self._taken = weights_version(self.watched())

    def watched(self) -> list:
        """The tensors the engine's memos derive from, read now: both input embeddings (a reloaded,
        moved or edited model shows there) and the target's key-norm weights (its key-norm scales)."""
        tensors = [None if m is None else m.get_input_embeddings().weight for m in self._models]
        return tensors + [getattr(n, "weight", None) for n in self._norms]

    def check(self) -> None:
        """Raise RuntimeError if a watched weight was replaced, moved or edited since the check."""
        if weights_version(self.watched()) != self._taken:
            raise RuntimeError(
                "the models' weights changed after this handoff engine was built (replaced, moved or "
                "edited in place): build a new engine, or call bridgecache.clear_engines()"
            )
