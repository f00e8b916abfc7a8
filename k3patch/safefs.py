"""Opening and reading inside the tree without trusting it: every directory is opened with
O_NOFOLLOW and a file is read (or hashed) only when it is a regular file, so a symlink, FIFO or
device is refused before any read, never followed or blocked on. The one reader of tree files.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import re
import secrets
import stat
from collections.abc import Callable
from pathlib import Path

from k3patch.errors import EnvironmentProblem

DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
# Non-blocking: opening a FIFO for reading would otherwise wait for a writer.
READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC

_HINTS = {
    errno.EROFS: "the filesystem is read-only; patch the image at build time instead",
    errno.EACCES: "permission denied; run as the tree's owner",
    errno.EPERM: "operation not permitted; run as the tree's owner",
    errno.ENOSPC: "no space left on the device; free some and run again",
    errno.EDQUOT: "disk quota exceeded; free some and run again",
}


def env_error(action: str, path: Path | str, exc: OSError) -> EnvironmentProblem:
    """The one-line error of a filesystem call that failed, with what to do about it."""
    hint = _HINTS.get(exc.errno or 0, exc.strerror or str(exc))
    return EnvironmentProblem(f"cannot {action} {path}: {hint}")


def not_plain(path: Path | str, what: str = "") -> EnvironmentProblem:
    return EnvironmentProblem(
        f"{path} is a symlink or not a regular {what or 'file'}; k3patch writes only real "
        "files and directories inside the tree. Remove it (reinstall vLLM if it was a package file)"
    )


class NotRegular(Exception):
    """The path is no regular file: `kind` is "symlink", "directory" or "special" (a FIFO,
    socket or device)."""

    def __init__(self, kind: str) -> None:
        super().__init__(kind)
        self.kind = kind


def open_regular(path: Path | str, *, dir_fd: int | None = None) -> int | None:
    """A read-only fd of the regular file at `path`, None when absent; NotRegular for anything
    else there, before a byte is read; other failures are the OSError itself."""
    try:
        fd = os.open(path, READ_FLAGS, dir_fd=dir_fd)
    except FileNotFoundError:
        return None
    except OSError as exc:
        if exc.errno == errno.ELOOP:  # O_NOFOLLOW met a symlink
            raise NotRegular("symlink") from None
        raise
    try:
        mode = os.fstat(fd).st_mode
    except BaseException:
        os.close(fd)
        raise
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise NotRegular("directory" if stat.S_ISDIR(mode) else "special")
    return fd


def read_file(path: Path | str, *, dir_fd: int | None = None) -> bytes | None:
    """The bytes of the regular file at `path`, None when absent (see open_regular)."""
    fd = open_regular(path, dir_fd=dir_fd)
    if fd is None:
        return None
    with open(fd, "rb") as file:
        return file.read()


def file_sha256(path: Path | str) -> str | None:
    """The sha256 of the regular file at `path`, None when absent (see open_regular)."""
    data = read_file(path)
    return None if data is None else hashlib.sha256(data).hexdigest()


def shared_mode(dir_fd: int, most: int) -> int:
    """The mode of a file (`most` 0o644) or directory (0o755) k3patch makes in the directory
    `dir_fd`: that directory's permission bits, writable by the owner only."""
    return stat.S_IMODE(os.fstat(dir_fd).st_mode) & most | (most & 0o600)


def give_to_owner_of(fd: int, dir_fd: int) -> bool:
    """A file or directory k3patch made takes the owner and group of the directory it is in,
    so that `.k3patch` and its files belong to the tree's owner whoever runs k3patch (root on
    a user's venv): the owner can revert and apply again. Only root can give a file away; for
    anyone else what the system allows is kept. True when its owner or group was changed."""
    have, want = os.fstat(fd), os.fstat(dir_fd)
    if (have.st_uid, have.st_gid) == (want.st_uid, want.st_gid):
        return False
    try:
        os.fchown(fd, want.st_uid, want.st_gid)
    except PermissionError:
        return False
    return True


def _make_dir(parent_fd: int, name: str) -> None:
    """The directory `name` in `parent_fd`, made whole under a temp name (the tree's owner, the
    parent's read bits) and only then renamed into place: a run killed at any step leaves no
    `name`, or one that belongs to the tree's owner, never one that is root's (a temp directory
    left by a kill is litter the next run removes). One that appeared meanwhile is kept."""
    tmp = f".{name}.k3patch-tmp.{secrets.token_hex(8)}"
    os.mkdir(tmp, 0o700, dir_fd=parent_fd)
    try:
        fd = os.open(tmp, DIR_FLAGS, dir_fd=parent_fd)
        try:
            give_to_owner_of(fd, parent_fd)
            os.fchmod(fd, shared_mode(parent_fd, 0o755))
        finally:
            os.close(fd)
        try:
            os.rename(tmp, name, src_dir_fd=parent_fd, dst_dir_fd=parent_fd)
        except OSError as exc:
            if exc.errno not in (errno.EEXIST, errno.ENOTEMPTY):
                raise
            os.rmdir(tmp, dir_fd=parent_fd)
    except BaseException:
        with contextlib.suppress(OSError):
            os.rmdir(tmp, dir_fd=parent_fd)
        raise


def give_state_to_owner(package_dir: Path | str) -> None:
    """`.k3patch`, its `blobs/` and the regular files in them given to the tree's owner (the
    package dir's), where this process may (root): repairs what a root run killed mid-way, or
    of an older k3patch, left root's, so that the owner can revert and apply again. Nothing is
    followed; what cannot be opened or given is left as it is."""
    for rel_dir in (".k3patch", ".k3patch/blobs"):
        with contextlib.suppress(OSError, EnvironmentProblem):
            parent = open_dir(package_dir, os.path.dirname(rel_dir))
            try:
                dfd = open_dir(package_dir, rel_dir)
                give_to_owner_of(dfd, parent)
            finally:
                os.close(parent)
            try:
                for entry in os.scandir(dfd):
                    with contextlib.suppress(OSError, NotRegular):
                        fd = open_regular(entry.name, dir_fd=dfd)
                        if fd is not None:
                            try:
                                give_to_owner_of(fd, dfd)
                            finally:
                                os.close(fd)
            finally:
                os.close(dfd)


def open_dir_if_there(root: Path | str, rel_dir: str, *, create: bool = False) -> int | None:
    """An fd of the directory `root/rel_dir`, every component opened without following a
    symlink; None when one is absent. With `create`, the directories missing on the way
    (k3patch's state directories) are made."""
    path = Path(root)
    try:
        fd = os.open(root, DIR_FLAGS)
        for part in [p for p in rel_dir.split("/") if p]:
            path = path / part
            try:
                if create:
                    try:
                        os.stat(part, dir_fd=fd, follow_symlinks=False)
                    except FileNotFoundError:
                        # The tree's owner owns k3patch's state, whoever runs it (root on a
                        # user's venv); whoever can read the tree reads it too: a `umask 077`
                        # apply must not hide the record from the users who run vLLM.
                        _make_dir(fd, part)
                nxt = os.open(part, DIR_FLAGS, dir_fd=fd)
                # One that a killed or older root run left root's is given back (root only).
                if create and give_to_owner_of(nxt, fd):
                    os.fchmod(nxt, shared_mode(fd, 0o755))
            finally:
                os.close(fd)
            fd = nxt
    except FileNotFoundError:
        return None
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR):
            raise not_plain(path, "directory") from None
        raise env_error("create the state directory" if create else "open", path, exc) from None
    return fd


def open_dir(root: Path | str, rel_dir: str, *, create: bool = False) -> int:
    """As open_dir_if_there, but a directory that is absent is an EnvironmentProblem too."""
    fd = open_dir_if_there(root, rel_dir, create=create)
    if fd is None:
        raise EnvironmentProblem(f"cannot open {Path(root) / rel_dir}: no such directory")
    return fd


def read_in(root: Path | str, rel: str, *, what: str = "file") -> bytes | None:
    """k3patch's own file `root/rel` (record, journal, saved copy): its bytes, None when it or a
    directory on the way is absent; anything but a regular file there, or a failed read, is an
    EnvironmentProblem that says which."""
    shown = Path(root) / rel
    dfd = open_dir_if_there(root, os.path.dirname(rel))
    if dfd is None:
        return None
    try:
        return read_file(os.path.basename(rel), dir_fd=dfd)
    except NotRegular:
        raise not_plain(shown, what) from None
    except OSError as exc:
        raise env_error(f"read the {what}", shown, exc) from None
    finally:
        os.close(dfd)


def regular_files(root: Path | str, rel_dir: str, pattern: re.Pattern[str]) -> list[str]:
    """The names matching `pattern` of the regular files in `root/rel_dir` (none when absent)."""
    return _names(root, rel_dir, pattern, lambda e: e.is_file(follow_symlinks=False))


def directories(root: Path | str, rel_dir: str, pattern: re.Pattern[str]) -> list[str]:
    """The names matching `pattern` of the directories (not links) in `root/rel_dir`."""
    return _names(root, rel_dir, pattern, lambda e: e.is_dir(follow_symlinks=False))


def entries(root: Path | str, rel_dir: str, pattern: re.Pattern[str]) -> list[str]:
    """The names matching `pattern` in `root/rel_dir`, whatever each is (a link: not followed)."""
    return _names(root, rel_dir, pattern, lambda e: True)


def _names(
    root: Path | str,
    rel_dir: str,
    pattern: re.Pattern[str],
    keep: Callable[[os.DirEntry[str]], bool],
) -> list[str]:
    dfd = open_dir_if_there(root, rel_dir)
    if dfd is None:
        return []
    try:
        return [e.name for e in os.scandir(dfd) if pattern.match(e.name) and keep(e)]
    finally:
        os.close(dfd)
