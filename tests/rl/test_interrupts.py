"""rl/run/interrupts.py: a Ctrl-C whose KeyboardInterrupt a library swallowed is still acted on."""

from __future__ import annotations

import os
import signal
import time

import pytest

from rl.run.interrupts import InterruptLatch, handled, latch, raise_if_interrupted


@pytest.fixture
def installed():
    current = InterruptLatch()
    previous = signal.signal(signal.SIGINT, current)
    try:
        yield current
    finally:
        signal.signal(signal.SIGINT, previous)


def swallowing_library_call() -> None:
    """What a wait loop that checks for signals and drops the error amounts to."""
    try:
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.5)  # the handler runs here and raises
    except KeyboardInterrupt:
        pass


def test_a_swallowed_ctrl_c_raises_at_the_next_check(installed):
    assert latch() is installed
    raise_if_interrupted()  # nothing pending
    swallowing_library_call()
    assert installed.pending()
    with pytest.raises(KeyboardInterrupt, match="during a library call"):
        raise_if_interrupted()
    raise_if_interrupted()  # raised once, not again


def test_after_handled_only_a_further_ctrl_c_counts(installed):
    with pytest.raises(KeyboardInterrupt, match="Ctrl-C"):
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.5)
    handled()  # the driver acts on it (the async loop starts stopping)
    raise_if_interrupted()
    swallowing_library_call()  # a second Ctrl-C, lost inside a wait
    with pytest.raises(KeyboardInterrupt):
        raise_if_interrupted()


def test_without_the_latch_nothing_is_checked():
    assert latch() is None  # pytest's own handler, or Python's default
    raise_if_interrupted()
