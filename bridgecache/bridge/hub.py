"""The Hugging Face Hub round trip, through huggingface_hub (its cache, token and offline mode).

    bridge = Bridge.from_pretrained("org/name", revision="v1")   # download() below
    bridge.push_to_hub("org/name")                               # push_to_hub() below

Downloads land in huggingface_hub's own cache (`cache_dir`, default `HF_HUB_CACHE`); with
`HF_HUB_OFFLINE=1` or `local_files_only=True` nothing is requested and the cached snapshot is used.
Knows huggingface_hub; the files themselves are `Bridge.save_pretrained`'s.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

__all__ = ["download", "push_to_hub"]


def download(
    repo_id: str,
    *,
    revision: str | None = None,
    cache_dir: str | Path | None = None,
    token: str | bool | None = None,
    local_files_only: bool = False,
) -> Path:
    """Fetch (or find in the cache) a bridge repo's files; returns the snapshot directory.

    bridge.json and the card come first; then only the tensors file bridge.json names (a repo
    holding other tensors files, stale or hostile, costs nothing)."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    from bridgecache.bridge.format import TENSORS_FILE

    options = dict(revision=revision, cache_dir=cache_dir, token=token, local_files_only=local_files_only)
    try:
        path = Path(snapshot_download(repo_id, allow_patterns=["bridge.json", "README.md"], **options))
        name = _tensors_name(path / "bridge.json")
        if TENSORS_FILE.fullmatch(name):  # else from_pretrained names the bad field
            snapshot_download(repo_id, allow_patterns=[name], **options)
    except LocalEntryNotFoundError as err:
        raise FileNotFoundError(
            f"bridge {repo_id!r} (revision {revision or 'main'}) is neither a local directory nor in the "
            f"Hub cache{f' {cache_dir}' if cache_dir else ''}, and the Hub cannot be reached or is "
            f"disabled (HF_HUB_OFFLINE / local_files_only): {err}"
        ) from err
    return path


def _tensors_name(meta_path: Path) -> str:
    """The tensors file a downloaded bridge.json names ("" if it cannot be read: load reports it)."""
    import json

    from bridgecache.bridge.format import MAX_JSON_BYTES

    try:
        if meta_path.stat().st_size > MAX_JSON_BYTES:
            return ""
        meta = json.loads(meta_path.read_bytes())
    except (OSError, ValueError, RecursionError):
        return ""
    name = meta.get("tensors_file", "bridge.safetensors") if isinstance(meta, dict) else ""
    return name if isinstance(name, str) else ""


def push_to_hub(
    bridge,
    repo_id: str,
    *,
    token: str | bool | None = None,
    private: bool | None = None,
    revision: str | None = None,
    commit_message: str = "Upload bridge",
    create_repo: bool = True,
) -> str:
    """Save `bridge` (tensors, metadata, card) to a temporary folder and upload it as one commit.

    Returns the commit URL huggingface_hub reports.
    """
    from huggingface_hub import HfApi

    api = HfApi(token=token)
    if create_repo:
        api.create_repo(repo_id, private=private, exist_ok=True, repo_type="model")
    with tempfile.TemporaryDirectory(prefix="bridgecache-push-") as folder:
        bridge.save_pretrained(folder)
        info = api.upload_folder(
            repo_id=repo_id,
            folder_path=folder,
            repo_type="model",
            revision=revision,
            commit_message=commit_message,
            delete_patterns=["bridge*.safetensors"],  # the tensors of a bridge this one replaces
        )
    return str(getattr(info, "commit_url", info))
