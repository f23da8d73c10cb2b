"""bridgecache: hand one LLM's KV cache to another.

cache = BridgedCache(bridge, source_cache, target, target_ids)
out = target.generate(target_ids, past_key_values=cache)
"""

from bridgecache.bridge.maps import Bridge, LayerMap
from bridgecache.fitting import fit_bridge
from bridgecache.kv.capture import CapturedKV, capture_kv
from bridgecache.kv.source import SourceKV, as_source, load_kv, save_kv
from bridgecache.models.spec import ModelSpec, SpecMismatchError, model_spec
from bridgecache.models.zoo import load_model, load_tokenizer
from bridgecache.runtime.batch import BatchHandoffResult, handoff_batch
from bridgecache.runtime.cache import BridgedCache
from bridgecache.runtime.handoff import HandoffResult, align_context, handoff

__version__ = "0.1.0"

__all__ = [
    "BatchHandoffResult",
    "Bridge",
    "BridgedCache",
    "CapturedKV",
    "HandoffResult",
    "LayerMap",
    "ModelSpec",
    "SourceKV",
    "SpecMismatchError",
    "align_context",
    "as_source",
    "capture_kv",
    "fit_bridge",
    "handoff",
    "handoff_batch",
    "load_kv",
    "load_model",
    "load_tokenizer",
    "model_spec",
    "save_kv",
]
