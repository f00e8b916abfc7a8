"""The tree's lock: an flock of the vLLM package directory, which k3patch never creates or
removes (no lock file to leave behind). Concurrent runs wait here, asleep, instead of each
classifying the tree; a process holds a tree's lock at most once and has one `--lock-timeout` in
all, however often the no-op path and the full path take the lock in turn.
"""

from __future__ import annotations

import contextlib
import fcntl
import math
import os
import time
from collections.abc import Iterator
from pathlib import Path

from k3patch.errors import BadLockTimeout, EnvironmentProblem
from k3patch.safefs import open_dir


class Busy(EnvironmentProblem):
    """Another run held the lock for longer than the timeout."""


# package dir -> (fd holding its flock, exclusive?, the deadline of this process's first wait)
_held: dict[str, tuple[int, bool, float]] = {}


def parse_timeout(text: str | float) -> float:
    """`--lock-timeout` as the CLI and the no-op path both read it: an ASCII number (Python's
    float() takes any Unicode digit, the typers' own parsers differ on that), finite, >= 0.
    ValueError, with the message a usage error shows, otherwise."""
    text = str(text)
    try:
        if not text.isascii():
            raise ValueError(text)
        value = float(text)
    except ValueError:
        raise ValueError(f"{text!r} is not a number") from None
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"{value} is not a finite number of seconds >= 0")
    return value


def _deadline(timeout: float) -> float:
    if not isinstance(timeout, int | float) or not math.isfinite(timeout) or timeout < 0:
        raise BadLockTimeout(f"--lock-timeout {timeout!r}: give a finite number of seconds >= 0")
    return time.monotonic() + timeout


def _take(key: str, mode: int, deadline: float, timeout: float) -> int:
    """An fd of the package dir `key` holding its flock in `mode`; Busy past `deadline`."""
    fd = open_dir(key, "")
    # Back off from 1 ms to 10 ms: dozens of ranks waiting on one tree must not eat the CPU that
    # the run holding the lock needs (a poll costs microseconds), and must see it let go soon.
    pause = 0.001
    try:
        while True:
            with contextlib.suppress(BlockingIOError):
                fcntl.flock(fd, mode | fcntl.LOCK_NB)
                return fd
            if time.monotonic() >= deadline:
                raise Busy(
                    f"another k3patch run holds the lock on {key} for over {timeout:g}s; "
                    "wait for it or raise --lock-timeout"
                )
            time.sleep(pause)
            pause = min(pause * 2, 0.01)
    except BaseException:
        os.close(fd)
        raise


@contextlib.contextmanager
def shared(package_dir: Path | str, timeout: float) -> Iterator[bool]:
    """Hold the tree's lock shared for a block of reads (status), so that no writer is half way
    through a commit while they run: a live writer is waited for first, at most `timeout`.
    Yields whether the lock is held (False: the directory cannot be opened by this user; the
    reads go on and a journal then reads as interrupted). A writer that keeps it longer is Busy:
    what it has written so far is no state to report."""
    key = os.path.abspath(package_dir)
    fd = None
    if key not in _held:
        try:
            fd = _take(key, fcntl.LOCK_SH, time.monotonic() + timeout, timeout)
        except Busy:
            raise Busy(
                f"another k3patch run has held the lock on {key} for over {timeout:g}s and may "
                "be half way through writing; run this again when it has ended"
            ) from None
        except EnvironmentProblem:
            pass
    try:
        yield key in _held or fd is not None
    finally:
        if fd is not None:
            os.close(fd)


def hold(package_dir: Path | str, timeout: float) -> None:
    """Take the tree's lock, exclusive, until `release` (or the process ends)."""
    key = os.path.abspath(package_dir)
    held = _held.get(key)
    if held is not None and held[1]:
        return
    # A shared hold (hold_or_wait) keeps its deadline: this process waits out one timeout.
    deadline = held[2] if held is not None else _deadline(timeout)
    release(key)  # a shared hold is given up first: flock cannot upgrade it atomically
    _held[key] = (_take(key, fcntl.LOCK_EX, deadline, timeout), True, deadline)


def hold_or_wait(package_dir: Path | str, timeout: float) -> bool:
    """True: this process now holds the lock (it is the one to do the work). False: another
    run holds it; we waited, asleep, until it let go, and now share the lock with every other
    waiter, so that all of them can read its result at once instead of one after another."""
    key = os.path.abspath(package_dir)
    if key in _held:
        return _held[key][1]
    deadline = _deadline(timeout)
    with contextlib.suppress(Busy):
        _held[key] = (_take(key, fcntl.LOCK_EX, 0.0, timeout), True, deadline)
        return True
    _held[key] = (_take(key, fcntl.LOCK_SH, deadline, timeout), False, deadline)
    return False


def release(package_dir: Path | str) -> None:
    held = _held.pop(os.path.abspath(package_dir), None)
    if held is not None:
        os.close(held[0])


@contextlib.contextmanager
def locked(package_dir: Path | str, timeout: float) -> Iterator[None]:
    """Hold the lock for a block; if this process already holds it, keep holding it after."""
    key = os.path.abspath(package_dir)
    already = key in _held and _held[key][1]
    hold(key, timeout)
    try:
        yield
    finally:
        if not already:
            release(key)
