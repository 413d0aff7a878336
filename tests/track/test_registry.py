"""The champion/challenger decision, on its own."""

from __future__ import annotations

from types import SimpleNamespace

from trainyard.track.registry import CHALLENGER, CHAMPION, decide


def version(v: str, acc: str | None) -> SimpleNamespace:
    return SimpleNamespace(version=v, tags={} if acc is None else {"test_accuracy": acc})


def test_first_version_becomes_champion():
    alias, reason = decide(0.5, None, margin=0.01)
    assert alias == CHAMPION and "first version" in reason


def test_better_by_more_than_margin_takes_champion():
    alias, reason = decide(0.93, version("3", "0.9100"), margin=0.01)
    assert alias == CHAMPION
    assert "beats champion v3 (0.9100)" in reason


def test_equal_or_within_margin_is_challenger():
    assert decide(0.91, version("3", "0.91"), margin=0.0)[0] == CHALLENGER
    alias, reason = decide(0.915, version("3", "0.91"), margin=0.01)
    assert alias == CHALLENGER and "champion stays" in reason


def test_worse_is_challenger():
    assert decide(0.5, version("1", "0.9"), margin=0.0)[0] == CHALLENGER


def test_champion_without_accuracy_is_replaced():
    alias, reason = decide(0.5, version("2", None), margin=0.0)
    assert alias == CHAMPION and "no test_accuracy tag" in reason


def test_the_same_accuracy_does_not_beat_its_own_rounded_tag():
    acc = 7 / 31  # 0.2258064516..., stored in the tag as 0.225806
    assert decide(acc, version("1", f"{acc:.6f}"), margin=0.0)[0] == CHALLENGER
    assert decide(acc + 1e-5, version("1", f"{acc:.6f}"), margin=0.0)[0] == CHAMPION
