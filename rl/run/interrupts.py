"""Ctrl-C and SIGTERM in the driver, never lost.

`InterruptLatch` is the driver's SIGINT and SIGTERM handler while Redis and Ray run
(rl/run/launch.py `services`): it raises KeyboardInterrupt, as Python's default handler does,
and also counts the signal. A KeyboardInterrupt raised inside library code that catches it
and goes on (a C extension checking for signals in its own wait loop and dropping the error, a
`__del__`) would otherwise lose a user's Ctrl-C: the run went on as if nothing had been
pressed. The loops call `raise_if_interrupted()` between waits: a signal counted and not yet
handled raises KeyboardInterrupt there. Where the driver handles one (the async loop starts
stopping), it calls `handled()`, so only a further Ctrl-C interrupts the stop.
"""

from __future__ import annotations

import logging
import signal

logger = logging.getLogger(__name__)


class InterruptLatch:
    """A signal handler that raises KeyboardInterrupt and remembers that it did."""

    def __init__(self) -> None:
        self.received = 0
        self.seen = 0

    def __call__(self, signum: int, frame: object) -> None:
        self.received += 1
        name = "Ctrl-C" if signum == signal.SIGINT else f"signal {signum}"
        raise KeyboardInterrupt(name)

    def pending(self) -> bool:
        """A signal arrived that no handled() has accounted for."""
        return self.received > self.seen

    def handled(self) -> None:
        self.seen = self.received


def latch() -> InterruptLatch | None:
    """The SIGINT handler when it is an InterruptLatch (inside `services`), else None."""
    handler = signal.getsignal(signal.SIGINT)
    return handler if isinstance(handler, InterruptLatch) else None


def raise_if_interrupted() -> None:
    """Raise KeyboardInterrupt for a signal the latch counted whose exception was swallowed."""
    current = latch()
    if current is not None and current.pending():
        current.handled()
        logger.warning("a Ctrl-C (or SIGTERM) was swallowed inside a library call; stopping now")
        raise KeyboardInterrupt("interrupt received during a library call")


def handled() -> None:
    """The driver has acted on every signal so far (it is stopping): only a later one counts."""
    current = latch()
    if current is not None:
        current.handled()
