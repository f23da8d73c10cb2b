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

__all__ = ["BRIDGE_FILES", "download", "push_to_hub"]

# bridge.json names its tensors file: bridge-<16 hex>.safetensors (bridge.safetensors in format 1).
BRIDGE_FILES = ("bridge.json", "bridge*.safetensors", "README.md")


def download(
    repo_id: str,
    *,
    revision: str | None = None,
    cache_dir: str | Path | None = None,
    token: str | bool | None = None,
    local_files_only: bool = False,
) -> Path:
    """Fetch (or find in the cache) a bridge repo's files; returns the snapshot directory."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        path = snapshot_download(
            repo_id,
            revision=revision,
            cache_dir=cache_dir,
            token=token,
            local_files_only=local_files_only,
            allow_patterns=list(BRIDGE_FILES),
        )
    except LocalEntryNotFoundError as err:
        raise FileNotFoundError(
            f"bridge {repo_id!r} (revision {revision or 'main'}) is neither a local directory nor in the "
            f"Hub cache{f' {cache_dir}' if cache_dir else ''}, and the Hub cannot be reached or is "
            f"disabled (HF_HUB_OFFLINE / local_files_only): {err}"
        ) from err
    return Path(path)


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
