"""Ctrl-C during a step: before any stage applies its update the step is abandoned at once; once one
has, the step finishes on every stage first, so an update is applied everywhere or nowhere."""
from __future__ import annotations

import contextlib
import signal
import threading
from typing import Callable, Iterator


@contextlib.contextmanager
def interrupts_after_commit(committing: Callable[[], bool]) -> Iterator[None]:
    """Inside the block, SIGINT goes to the handler in force at once while ``committing()`` is false, and is
    held until the block ends (then delivered) once it is true. Signals only reach the main thread, and a
    SIGINT that is ignored or left to the system's default stays as it is."""
    previous = signal.getsignal(signal.SIGINT)
    if threading.current_thread() is not threading.main_thread() or not callable(previous):
        yield
        return
    held: list = []

    def handler(signum, frame):
        if committing():
            held.append(frame)
        else:
            previous(signum, frame)

    signal.signal(signal.SIGINT, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
    if held:
        previous(signal.SIGINT, held[0])
