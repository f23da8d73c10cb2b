"""The demo's last line: what it measured, in the user's terms (never a goal of ours)."""

from __future__ import annotations

from bridgecache.cli.demo import _verdict
from bridgecache.runtime.config import RefreshConfig


def test_a_right_answer_sooner_says_how_much_and_where_more_is_saved():
    line = _verdict("Heron", "the Heron's crew", "The Heron", 1.43, RefreshConfig(0.2), hint_longer=True)
    assert line == (
        "result: the bridged target answered 'Heron', as after reading the document itself; 1.4x sooner "
        "to the first token than the target reading the document itself, on this machine; the handoff "
        "saves more on longer documents: --context-tokens 4096."
    )
    assert "goal" not in line


def test_a_missed_answer_and_a_slower_handoff_are_said_plainly():
    line = _verdict("Heron", "Heron", "a gull", 0.5, RefreshConfig(0.2), hint_longer=False)
    assert "missed 'Heron', which the target found after reading the document itself" in line
    assert "--refresh 0.40" in line and "2.0x later to the first token" in line
    assert "--context-tokens" not in line
    line = _verdict("Heron", "a gull", "a gull", 1.0, RefreshConfig(0.2), hint_longer=False)
    assert "misses 'Heron' even after reading the document itself" in line and "about as soon" in line
    line = _verdict(None, "x", "y", 2.0, None, hint_longer=False)
    assert line.startswith("result: 2.0x sooner") and "no --answer given" in line
