"""The GIL hand-over of the policy's batch-end work (``iosched/runtime/_prefetch.py``,
``release_gil``): it sleeps with the thread's timer slack cut short, and gives the thread its
own slack back whatever happens."""

from __future__ import annotations

import sys
import time

import pytest

from iosched.runtime import _prefetch

linux_only = pytest.mark.skipif(_prefetch._PRCTL is None,
                                reason="prctl(PR_SET_TIMERSLACK) is Linux's; elsewhere the plain sleep(0)")


def _slack() -> int:
    prctl = _prefetch._PRCTL
    assert prctl is not None
    return prctl(_prefetch._PR_GET_TIMERSLACK, 0)


@linux_only
def test_the_hand_over_sleeps_with_a_short_slack_and_puts_the_threads_back(
        monkeypatch: pytest.MonkeyPatch) -> None:
    before = _slack()
    seen: list[tuple[float, int]] = []
    real_sleep = time.sleep

    def sleep(seconds: float) -> None:
        seen.append((seconds, _slack()))
        real_sleep(seconds)

    monkeypatch.setattr(time, "sleep", sleep)
    _prefetch.release_gil()
    assert seen == [(0, _prefetch.HANDOVER_SLACK_NS)]
    assert _slack() == before


@linux_only
def test_a_slack_the_thread_chose_is_kept() -> None:
    prctl = _prefetch._PRCTL
    assert prctl is not None
    before = _slack()
    try:
        prctl(_prefetch._PR_SET_TIMERSLACK, 123_456)
        _prefetch.release_gil()
        assert _slack() == 123_456
    finally:
        prctl(_prefetch._PR_SET_TIMERSLACK, before)


@linux_only
def test_the_slack_comes_back_when_the_sleep_raises(monkeypatch: pytest.MonkeyPatch) -> None:
    before = _slack()

    def interrupted(seconds: float) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(time, "sleep", interrupted)
    with pytest.raises(KeyboardInterrupt):
        _prefetch.release_gil()
    assert _slack() == before


def test_without_prctl_it_is_the_plain_sleep(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[float] = []
    monkeypatch.setattr(_prefetch, "_PRCTL", None)
    monkeypatch.setattr(time, "sleep", seen.append)
    _prefetch.release_gil()
    assert seen == [0]


def test_prctl_is_found_on_linux() -> None:
    assert (_prefetch._PRCTL is not None) == sys.platform.startswith("linux")
