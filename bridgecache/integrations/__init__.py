"""Serving engines: translated KV as engine pages.

`pages` (no engine import): publish a BridgedCache's full pages under the target's page-hash
chain, namespaced by source, target, bridge and salt; read them back verified.
`sglang`: a HiCache L3 storage backend and a HiCacheFile exporter (imports sglang).
`vllm`: a KV connector (kv_consumer) that loads published pages into vLLM's paged cache.
See docs/serving.md.
"""

from bridgecache.integrations.pages import (
    EngineMismatchError,
    PageFormatError,
    PageStore,
    Published,
    bridge_salt,
    page_keys,
    publish,
    publish_context,
)

__all__ = [
    "EngineMismatchError",
    "PageFormatError",
    "PageStore",
    "Published",
    "bridge_salt",
    "page_keys",
    "publish",
    "publish_context",
]
