"""Page keys and namespaces: which key a translated page is stored under, and for whom.

A serving engine finds a cached prefix by a chain of page hashes over the token ids. SGLang
0.5.23's chain (mem_cache/utils.py `get_hash_str`, `storage_namespace_seed`): page i's key is
sha256(key of page i-1, or the namespace seed, || token ids as little-endian u32), in hex. The
seed comes from the request's (extra_key, cache_salt); our cache_salt (`bridge_salt`) names the
source, target, bridge and a user salt, so bridged pages can only answer a request that asked for
that translation, never another request's exact prefix lookup.

`check_page_key` is the one gate every key read from a file or handed in by a caller passes
before it names a file or a storage object: 64 lowercase hex digits, nothing else.

Knows nothing about files, engines or caches.
"""

from __future__ import annotations

import hashlib
import json
import re
import struct
from collections.abc import Sequence

import torch

from bridgecache.runtime.config import HandoffConfig

__all__ = [
    "EngineMismatchError",
    "bridge_fingerprint",
    "bridge_salt",
    "check_page_key",
    "head_range",
    "namespace_seed",
    "page_keys",
]

_U32_MAX = 2**32 - 1
_HEX64 = re.compile(r"[0-9a-f]{64}")


class EngineMismatchError(ValueError):
    """Published pages do not fit the engine's model (architecture, heads, head dim, dtype...)."""


def check_page_key(key: object, where: str = "page key") -> str:
    """`key` if it is a page key (64 lowercase hex digits: a sha256 in hex); else ValueError.

    Keys become file and object names: anything else ("../x", "a/b", "") is refused here."""
    if not isinstance(key, str) or not _HEX64.fullmatch(key):
        shown = repr(key)[:80]
        raise ValueError(f"{where} is {shown}; expected 64 lowercase hex digits (a sha256 digest)")
    return key


def namespace_seed(extra_key: str | None = None, cache_salt: str | None = None) -> str | None:
    """SGLang's `storage_namespace_seed`: the hex seed of a request's page-hash chain.

    None when the request carries neither field (then the chain starts unseeded)."""
    if extra_key is None and cache_salt is None:
        return None
    digest = hashlib.sha256(b"sglang-cache-namespace-v1")
    for part in (extra_key, cache_salt):
        if part is None:
            digest.update(b"\x00")
            continue
        encoded = part.encode("utf-8")
        digest.update(b"\x01" + len(encoded).to_bytes(8, "little") + encoded)
    return digest.hexdigest()


def page_keys(token_ids: Sequence[int], page_size: int, seed: str | None = None) -> list[str]:
    """Hex keys of the FULL pages of `token_ids`, chained from `seed` (SGLang `get_hash_str`).

    A trailing partial page gets no key: only whole pages are ever published or looked up."""
    if page_size < 1:
        raise ValueError(f"page_size must be >= 1, got {page_size}")
    tokens = [int(t) for t in token_ids]
    prior = bytes.fromhex(seed) if seed else None
    keys = []
    for start in range(0, len(tokens) - page_size + 1, page_size):
        page = tokens[start : start + page_size]
        digest = hashlib.sha256()
        if prior is not None:
            digest.update(prior)
        if any(t < 0 for t in page):
            raise ValueError(f"token ids must be >= 0; page {start // page_size} has {min(page)}")
        if any(t > _U32_MAX for t in page):
            # SGLang's "wide" pages: a 0xff tag, then the ids as little-endian u64.
            digest.update(b"\xff" + struct.pack(f"<{len(page)}Q", *page))
        else:
            digest.update(struct.pack(f"<{len(page)}I", *page))
        prior = digest.digest()
        keys.append(prior.hex())
    return keys


def _tensor_bytes(tensor: torch.Tensor) -> bytes:
    return tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def bridge_fingerprint(bridge) -> str:
    """sha256 over a bridge's specs, settings and every mapping tensor (hex)."""
    digest = hashlib.sha256()
    head = {
        "source": bridge.source.to_dict(),
        "target": bridge.target.to_dict(),
        "method": bridge.method,
        "alignment_policy": bridge.alignment_policy,
        "native_head": bridge.native_head,
    }
    digest.update(json.dumps(head, sort_keys=True).encode())
    for layer in bridge.layers:
        for tensor in (layer.inputs, layer.key_weight, layer.key_bias, layer.value_weight, layer.value_bias):
            digest.update(_tensor_bytes(tensor))
    return digest.hexdigest()


def bridge_salt(bridge, salt: str = "", *, config=None) -> str:
    """The `cache_salt` a request sends to be served pages translated by `bridge`.

    Names the source, the target, the bridge (all its tensors), what of the `HandoffConfig`
    changes the published KV (`config.kv_recipe`; None: the default config's) and a user salt
    (e.g. a tenant): pages refreshed another way never answer for these."""
    recipe = (config or HandoffConfig()).kv_recipe
    digest = hashlib.sha256(b"bridgecache-namespace-v2\x00")
    for part in (bridge_fingerprint(bridge), recipe, salt):
        digest.update(part.encode("utf-8") + b"\x00")
    return "bridgecache-" + digest.hexdigest()[:32]


def head_range(total_kv_heads: int, tp_rank: int, tp_size: int) -> range:
    """The KV heads tensor-parallel rank `tp_rank` of `tp_size` holds (both engines' rule:
    contiguous slices, or whole heads replicated when there are more ranks than heads)."""
    if not 0 <= tp_rank < tp_size:
        raise ValueError(f"tp_rank {tp_rank} is outside [0, tp_size={tp_size})")
    if tp_size <= total_kv_heads:
        if total_kv_heads % tp_size:
            raise EngineMismatchError(f"{total_kv_heads} KV heads do not split over tp_size={tp_size}")
        per = total_kv_heads // tp_size
        return range(tp_rank * per, (tp_rank + 1) * per)
    if tp_size % total_kv_heads:
        raise EngineMismatchError(f"tp_size={tp_size} is not a multiple of the {total_kv_heads} KV heads")
    head = tp_rank // (tp_size // total_kv_heads)
    return range(head, head + 1)
