"""Serving engines and fleet stores: translated KV as engine pages.

`keys`: page keys (SGLang's hash chain), bridge namespaces and salts, key validation.
`pages`: the page store directory and its verified reads (no engine import).
`publish`: translate a context once and publish its full pages to a page store, any SGLang
HiCache L3 store, or LMCache.
`hicache`: pages into any SGLang `HiCacheStorage` through its own batch_set(_v1) (imports sglang).
`sglang`: a HiCache L3 storage backend serving the page store, and a HiCacheFile exporter.
`vllm`: a KV connector (kv_consumer) that loads page-store pages into vLLM's paged cache.
`lmcache`: a publisher that stores pages as LMCache chunks (vLLM + LMCache fleets).
See docs/serving.md.
`lm_eval`: lm-evaluation-harness's model "bridgecache" (imports lm_eval; never imported here;
docs/lm-eval.md).
"""

from bridgecache.integrations.keys import EngineMismatchError, bridge_salt, check_page_key, page_keys
from bridgecache.integrations.pages import PageFormatError, PageStore
from bridgecache.integrations.publish import BridgedPages, Published, publish, publish_context

__all__ = [
    "BridgedPages",
    "EngineMismatchError",
    "PageFormatError",
    "PageStore",
    "Published",
    "bridge_salt",
    "check_page_key",
    "page_keys",
    "publish",
    "publish_context",
]
