"""A child process for the reliability tests: saves a bridge or a KV file the way a user would,
but can stop at a named step (it writes MARKER, then sleeps) so the parent can SIGKILL it
exactly there, or wait at a barrier so two workers commit at the same moment.

    python save_worker.py MODE SOURCE DEST MARKER

MODE: tensors   stop with half of the tensors file written
      pointer   stop with the new tensors and card in place, before bridge.json moves
      cleanup   stop after bridge.json moved, before the old tensors file is removed
      create    wait for the other worker, then save with overwrite=False (exit 3 if refused)
      replace   wait for the other worker, then save with overwrite=True
      flip      save SOURCE and MARKER (a second bridge) into DEST in turn, 20 times
      kv        save_kv the KV file SOURCE to DEST, stopping with half of it written
SOURCE is a bridge directory (a KV file for kv). For create/replace, MARKER is this worker's
ready file; the barrier waits until the folder holds two of them.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path


def _stop_here(marker: str) -> None:
    Path(marker).write_text(str(os.getpid()))
    time.sleep(600)  # the parent kills us here


def _half_written(real_save, marker: str):
    def save(tensors, path, *args, **kwargs):
        real_save(tensors, path, *args, **kwargs)
        data = Path(path).read_bytes()
        Path(path).write_bytes(data[: len(data) // 2])
        _stop_here(marker)

    return save


def main(mode: str, source: str, dest: str, marker: str) -> int:
    import bridgecache.bridge.storage as bridge_module
    import bridgecache.kv.files as source_module
    from bridgecache.bridge.maps import Bridge

    if mode == "kv":
        kv = source_module.load_kv(source)
        source_module.save_file = _half_written(source_module.save_file, marker)
        source_module.save_kv(dest, kv)
        return 0
    bridge = Bridge.from_pretrained(source)
    if mode == "tensors":
        bridge_module.save_file = _half_written(bridge_module.save_file, marker)
    elif mode == "pointer":
        real_publish = bridge_module.publish

        def publish(temporary, final, **kwargs):
            if Path(final).name == "bridge.json":
                _stop_here(marker)
            return real_publish(temporary, final, **kwargs)

        bridge_module.publish = publish
    elif mode == "cleanup":
        bridge_module._remove_unreferenced = lambda *args, **kwargs: _stop_here(marker)
    elif mode in ("create", "replace"):
        real_lock = bridge_module.directory_lock

        def barrier_then_lock(directory, *args, **kwargs):  # only the commit takes this name's lock
            Path(marker).write_text("ready")
            deadline = time.time() + 120
            while len(list(Path(marker).parent.glob("ready-*"))) < 2 and time.time() < deadline:
                time.sleep(0.005)
            return real_lock(directory, *args, **kwargs)

        bridge_module.directory_lock = barrier_then_lock
    elif mode == "flip":
        other = Bridge.from_pretrained(marker)
        for _ in range(20):
            bridge.save_pretrained(dest)
            other.save_pretrained(dest)
        return 0
    try:
        bridge.save_pretrained(dest, overwrite=mode != "create")
    except FileExistsError as err:
        print(f"refused: {err}", file=sys.stderr)
        return 3
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
