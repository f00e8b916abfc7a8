"""Opening and reading inside the tree without trusting it: every directory from the package
dir down is opened with O_NOFOLLOW, and a file is read only when it is a regular file (a
symlink, FIFO or device is refused before any read, never followed or blocked on). The writer
(transaction.py) and the record (state.py) both read through here.
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

from k3patch.lock import EnvironmentProblem, env_error

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


def _not_plain(path: Path | str, what: str = "") -> EnvironmentProblem:
    return EnvironmentProblem(
        f"{path} is a symlink or not a regular {what or 'file'}; k3patch writes only real "
        "files and directories inside the tree. Remove it (reinstall vLLM if it was a package file)"
    )


def open_dir(root: Path | str, rel_dir: str, *, create: bool = False) -> int:
    """An fd of `root/rel_dir`, every component opened without following a symlink."""
    try:
        fd = os.open(root, _DIR_FLAGS)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR):
            raise _not_plain(root, "directory") from None
        raise env_error("open", root, exc) from None
    path = Path(root)
    for part in [p for p in rel_dir.split("/") if p]:
        path = path / part
        try:
            if create:
                try:
                    os.mkdir(part, 0o755, dir_fd=fd)
                except FileExistsError:
                    pass
            nxt = os.open(part, _DIR_FLAGS, dir_fd=fd)
        except OSError as exc:
            os.close(fd)
            if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                raise _not_plain(path, "directory") from None
            raise env_error("open", path, exc) from None
        os.close(fd)
        fd = nxt
    return fd


def _read_fd(fd: int) -> bytes:
    chunks = []
    while chunk := os.read(fd, 1 << 20):
        chunks.append(chunk)
    return b"".join(chunks)


def read_regular(
    path: Path | str, *, what: str = "file", dir_fd: int | None = None
) -> bytes | None:
    """A regular file's bytes, None when absent; never follows a symlink, never opens a FIFO
    or device (O_NONBLOCK, then fstat), and says which when it is not a plain file."""
    try:
        fd = os.open(path, _READ_FLAGS, dir_fd=dir_fd)
    except FileNotFoundError:
        return None
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR, errno.EISDIR):
            raise _not_plain(path, what) from None
        raise env_error(f"read the {what}", path, exc) from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise _not_plain(path, what)
        return _read_fd(fd)
    except OSError as exc:
        raise env_error(f"read the {what}", path, exc) from None
    finally:
        os.close(fd)
