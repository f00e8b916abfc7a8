"""The tree's lock, and the error every unwritable-tree case becomes.

Standard library only and cheap to import: the no-op path takes the lock before it decides to
hand over to the full path, so concurrent entrypoints wait here, asleep, instead of each
classifying the tree. A process holds a tree's lock at most once; taking it again is a no-op.
"""

from __future__ import annotations

import atexit
import errno
import fcntl
import math
import os
import time

from k3patch.errors import BadLockTimeout, EnvironmentProblem

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing (start-up cost)

if TYPE_CHECKING:
    from pathlib import Path

_HINTS = {
    errno.EROFS: "the filesystem is read-only; patch the image at build time instead",
    errno.EACCES: "permission denied; run as the tree's owner",
    errno.EPERM: "operation not permitted; run as the tree's owner",
    errno.ENOSPC: "no space left on the device; free some and run again",
    errno.EDQUOT: "disk quota exceeded; free some and run again",
}


def env_error(action: str, path: Path | str, exc: OSError) -> EnvironmentProblem:
    hint = _HINTS.get(exc.errno or 0, exc.strerror or str(exc))
    return EnvironmentProblem(f"cannot {action} {path}: {hint}")


def check_timeout(timeout: float) -> float:
    if not isinstance(timeout, int | float) or not math.isfinite(timeout) or timeout < 0:
        raise BadLockTimeout(f"--lock-timeout {timeout!r}: give a finite number of seconds >= 0")
    return float(timeout)


# state dir -> (the fd whose flock this process holds, exclusive?); closed at exit at the latest
_held: dict[str, tuple[int, bool]] = {}
# state dir -> the monotonic deadline of this process's first wait: one timeout in all, however
# many times the no-op path and the full path take the lock in turn.
_deadlines: dict[str, float] = {}


def _deadline(key: str, timeout: float) -> float:
    check_timeout(timeout)
    return _deadlines.setdefault(key, time.monotonic() + timeout)


def wait_if_busy(state_dir: Path | str, timeout: float) -> bool:
    """True when another live run holds the lock (we waited, shared, until it let go, at most
    `timeout`): its journal is work in progress, not an interrupted run's."""
    key = os.path.abspath(state_dir)
    if key in _held:
        return False
    try:
        fd = os.open(key, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except OSError:
        return False
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            return False
        except BlockingIOError:
            pass
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            time.sleep(0.01)
            try:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                continue
        return True
    finally:
        os.close(fd)


def hold(state_dir: Path | str, timeout: float) -> None:
    """Take the lock of a tree for the rest of this process: an flock of the `.k3patch`
    directory itself, so no lock file is left behind. A directory removed by a revert while we
    waited is noticed (its inode changed) and the lock is taken on the new one."""
    key = os.path.abspath(state_dir)
    if _held.get(key, (0, False))[1]:
        return
    deadline = _deadline(key, timeout)
    release(key)
    try:
        _held[key] = (_acquire(key, fcntl.LOCK_EX, deadline, timeout), True)
    finally:
        _deadlines.pop(key, None)


def hold_or_wait(state_dir: Path | str, timeout: float) -> bool:
    """True: this process now holds the lock (it is the one to do the work). False: another
    run holds it; we waited, asleep, until it let go, and now share the lock with every other
    waiter, so that all of them can read its result at once instead of one after another."""
    key = os.path.abspath(state_dir)
    if key in _held:
        return _held[key][1]
    deadline = _deadline(key, timeout)
    try:
        _held[key] = (_acquire(key, fcntl.LOCK_EX, 0.0, timeout), True)
        return True
    except EnvironmentProblem as exc:
        if not isinstance(exc, _Busy):
            raise
    try:
        _held[key] = (_acquire(key, fcntl.LOCK_SH, deadline, timeout), False)
    except BaseException:
        _deadlines.pop(key, None)
        raise
    return False


class _Busy(EnvironmentProblem):
    pass


def _acquire(key: str, mode: int, deadline: float, timeout: float) -> int:
    while True:
        try:
            try:
                os.mkdir(key, 0o755)
            except FileExistsError:
                pass
            # Never through a symlink: the lock and everything under it must be the tree's own.
            fd = os.open(key, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
        except FileNotFoundError:
            if os.path.isdir(os.path.dirname(key)):
                continue  # removed by a finishing revert between our mkdir and open: again
            raise env_error("create the state directory", key, FileNotFoundError()) from None
        except OSError as exc:
            if exc.errno in (errno.ELOOP, errno.ENOTDIR, errno.EEXIST):
                raise EnvironmentProblem(
                    f"{key} is a symlink or not a directory; k3patch keeps its state only in a "
                    "real directory inside the tree. Remove it and run again"
                ) from None
            raise env_error("create the state directory", key, exc) from None
        try:
            # Back off from 1 ms to 10 ms: dozens of ranks waiting on one tree must not eat
            # the CPU that the run holding the lock needs (a poll costs microseconds), and
            # must see it let go soon after it does.
            pause = 0.001
            while True:
                try:
                    fcntl.flock(fd, mode | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if time.monotonic() >= deadline:
                        raise _Busy(
                            f"another k3patch run holds the lock on {key} for over "
                            f"{timeout:g}s; wait for it or raise --lock-timeout"
                        ) from None
                    time.sleep(pause)
                    pause = min(pause * 2, 0.01)
            try:
                same = os.stat(key).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                same = False
        except BaseException:
            os.close(fd)
            raise
        if same:
            return fd
        os.close(fd)


def release(state_dir: Path | str) -> None:
    """Give the lock back. A state dir this run created and left empty (nothing to write, a
    refusal, an error) is removed first, so a run that wrote nothing leaves no trace."""
    key = os.path.abspath(state_dir)
    held = _held.pop(key, None)
    _deadlines.pop(key, None)
    if held is None:
        return
    try:
        # Only the directory this run locked: after a revert removed it, the one at this path
        # may be another run's, freshly created and locked.
        mine, there = os.fstat(held[0]), os.stat(key, follow_symlinks=False)
        if held[1] and (mine.st_dev, mine.st_ino) == (there.st_dev, there.st_ino):
            os.rmdir(key)
    except OSError:
        pass
    os.close(held[0])


@atexit.register
def _release_all() -> None:
    for key in list(_held):
        release(key)


class locked:
    """Hold the lock for a block; if this process already holds it, keep holding it after.
    A class, not `contextlib.contextmanager`: this module is on the no-op path's imports."""

    def __init__(self, state_dir: Path | str, timeout: float) -> None:
        self.key, self.timeout = os.path.abspath(state_dir), timeout
        self.already = False

    def __enter__(self) -> None:
        self.already = _held.get(self.key, (0, False))[1]
        hold(self.key, self.timeout)

    def __exit__(self, *exc_info: object) -> None:
        if not self.already:
            release(self.key)
