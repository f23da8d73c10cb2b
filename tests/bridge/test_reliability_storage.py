"""A bridge saved into a folder that does not exist yet appears whole or not at all: a SIGKILL at
any step leaves no folder (never a tensors file without bridge.json), and the next save into the
same parent removes the hidden staging folder the killed writer left."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from tiny_models import tiny_model

from bridgecache.bridge.maps import Bridge
from bridgecache.files import STAGING_PREFIX

WORKER = Path(__file__).resolve().parents[1] / "save_worker.py"


def _killed_at(step: str, source: Path, dest: Path, marker: Path) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    child = subprocess.Popen(
        [sys.executable, str(WORKER), step, str(source), str(dest), str(marker)],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    deadline = time.time() + 300
    while not marker.exists():
        if child.poll() is not None:
            raise AssertionError(f"the worker ended before its step: {child.communicate()[1][-2000:]}")
        assert time.time() < deadline, "the worker never reached its step"
        time.sleep(0.05)
    os.kill(child.pid, signal.SIGKILL)
    child.communicate()
    assert child.returncode == -signal.SIGKILL


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    bridge = Bridge.identity(tiny_model("qwen2"))
    return bridge, bridge.save_pretrained(tmp_path_factory.mktemp("source") / "bridge")


@pytest.mark.parametrize("step", ["tensors", "pointer"])
def test_a_save_into_a_new_folder_killed_at_any_step_leaves_no_folder(saved, tmp_path, step):
    bridge, source = saved
    parent = tmp_path / "bridges"
    dest = parent / "new"
    _killed_at(step, source, dest, tmp_path / "stopped")
    assert not dest.exists()  # not a folder holding an orphan tensors file
    assert [p.name for p in parent.iterdir() if not p.name.startswith(STAGING_PREFIX)] == []
    bridge.save_pretrained(parent / "other")  # the next save there cleans what the kill left
    assert sorted(p.name for p in parent.iterdir()) == ["other"]
    assert Bridge.from_pretrained(parent / "other").method == bridge.method


def test_a_new_folder_gets_the_umasks_mode_and_every_file(saved, tmp_path):
    bridge, _ = saved
    dest = bridge.save_pretrained(tmp_path / "a" / "b")
    mask = os.umask(0)
    os.umask(mask)
    assert os.stat(dest).st_mode & 0o777 == 0o777 & ~mask
    names = sorted(p.name for p in dest.iterdir())
    assert names[0] == "README.md" and names[1].startswith("bridge-") and names[2] == "bridge.json"
    assert len(names) == 3 and sorted(p.name for p in dest.parent.iterdir()) == ["b"]
    with pytest.raises(FileExistsError):
        bridge.save_pretrained(dest, overwrite=False)
