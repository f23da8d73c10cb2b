"""bridgecache: hand one LLM's KV cache to another.

    bridge = fit_bridge(source, target, source_tok, target_tok, FitConfig(num_sequences=64))
    result = handoff(bridge, source, target, context, prompt, source_tokenizer=s, target_tokenizer=t)

    cache = BridgedCache(bridge, capture_kv(source, source_ids), target, target_ids, source_model=source)
    out = target.generate(target_ids, past_key_values=cache)

Floors, lower never importing upper: models/ (where a model comes from, what it is) -> bridge/
(the maps as files) and kv/ (a context's KV, alignment) -> runtime/ (the cache, translation,
native work, handoffs) -> fitting/ and evaluation/ -> integrations/ -> cli/.
"""

from bridgecache import _checkout, _moved  # noqa: F401 (_checkout first: bridgecache.kernels in a checkout)
from bridgecache.bridge import Bridge, BridgeFormatError, LayerMap
from bridgecache.fitting import FitConfig, fit_bridge
from bridgecache.kv.capture import capture_kv
from bridgecache.kv.files import as_source, load_kv, save_kv
from bridgecache.kv.source import KVFileError, KVMismatchError, SourceKV
from bridgecache.models.layout import UnsupportedArchitectureError
from bridgecache.models.spec import ModelSpec, SpecMismatchError, model_spec
from bridgecache.models.zoo import load_model, load_tokenizer
from bridgecache.runtime.cache import BridgedCache
from bridgecache.runtime.config import HandoffConfig, QualityPolicy, RefreshConfig
from bridgecache.runtime.engine import HandoffEngine, clear_engines
from bridgecache.runtime.entry.batch import BatchHandoffResult, handoff_batch
from bridgecache.runtime.entry.conversation import Conversation, Turn
from bridgecache.runtime.entry.handoff import HandoffResult, align_context, handoff, tokenize_context
from bridgecache.runtime.report import HandoffReport
from bridgecache.runtime.selection.rules import (
    GivenScores,
    KeyDeviation,
    SelectionRequest,
    Selector,
    SourceAttention,
)

_moved.install()  # old module paths keep working, with a DeprecationWarning (bridgecache._moved)

__version__ = "0.2.0"

__all__ = [
    "BatchHandoffResult",
    "Bridge",
    "BridgeFormatError",
    "BridgedCache",
    "Conversation",
    "FitConfig",
    "GivenScores",
    "HandoffConfig",
    "HandoffEngine",
    "HandoffReport",
    "HandoffResult",
    "KVFileError",
    "KVMismatchError",
    "KeyDeviation",
    "LayerMap",
    "ModelSpec",
    "QualityPolicy",
    "RefreshConfig",
    "SelectionRequest",
    "Selector",
    "SourceAttention",
    "SourceKV",
    "SpecMismatchError",
    "Turn",
    "UnsupportedArchitectureError",
    "align_context",
    "as_source",
    "capture_kv",
    "clear_engines",
    "fit_bridge",
    "handoff",
    "handoff_batch",
    "load_kv",
    "load_model",
    "load_tokenizer",
    "model_spec",
    "save_kv",
    "tokenize_context",
]
