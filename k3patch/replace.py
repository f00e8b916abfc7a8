"""Replacing one file inside the tree so that a reader sees the old file or the new, never a mix:
a temp file beside it (O_CREAT|O_EXCL|O_NOFOLLOW under an unpredictable name, so a planted link is
never written through), fsynced, with the owner, mode and xattrs of the file it replaces, renamed
over it. `replace_checked` also keeps another writer's edit (see there).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import re
import secrets
import stat
from collections.abc import Callable
from pathlib import Path

from k3patch.errors import ConcurrentChange, EnvironmentProblem
from k3patch.safefs import (
    NotRegular,
    env_error,
    not_plain,
    open_dir,
    open_dir_if_there,
    open_regular,
    read_fd,
    shared_mode,
)

# What `_new_temp` names a temp file: only files named so are ever removed as litter.
LITTER = re.compile(r"^\..+\.k3patch-tmp\.[0-9a-f]+$")


def _copy_xattrs(src_fd: int, dst_fd: int) -> None:
    """Security labels and ACLs (system.posix_acl_access) travel with the file."""
    with contextlib.suppress(OSError):
        for name in os.listxattr(src_fd):
            with contextlib.suppress(OSError):
                os.setxattr(dst_fd, name, os.getxattr(src_fd, name))


def _new_temp(dfd: int, name: str) -> tuple[str, int]:
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    for _ in range(16):
        tmp = f".{name}.k3patch-tmp.{secrets.token_hex(8)}"
        with contextlib.suppress(FileExistsError):
            return tmp, os.open(tmp, flags, 0o600, dir_fd=dfd)
    raise FileExistsError(errno.EEXIST, "no free temp name", name)


def _keep_owner(fd: int, like: os.stat_result, name: str) -> None:
    """Give the temp file `fd` the owner and group of `like`, changing only what differs (in a
    setgid directory there may be nothing to change, and no chown to be refused)."""
    have = os.fstat(fd)
    uid = like.st_uid if like.st_uid != have.st_uid else -1
    gid = like.st_gid if like.st_gid != have.st_gid else -1
    if uid == gid == -1:
        return
    try:
        os.fchown(fd, uid, gid)
    except PermissionError:
        who = f"uid {os.geteuid()} (groups {', '.join(map(str, os.getgroups()))})"
        raise EnvironmentProblem(
            f"cannot keep the owner and group {like.st_uid}:{like.st_gid} of {name}: {who} "
            f"may not give a file {'owner ' + str(uid) if uid != -1 else 'group ' + str(gid)}"
            f"{' (not one of its groups)' if uid == -1 else ''}. Run as root or as a member of "
            "that group, or make the directory setgid to that group"
        ) from None


def write_temp(dfd: int, name: str, data: bytes, like_fd: int | None) -> str:
    """A new temp file beside `name` in `dfd` holding `data`, fsynced, with the owner, mode and
    xattrs of `like_fd` (or the directory's read bits, see shared_mode); returns its name."""
    tmp, fd = _new_temp(dfd, name)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        if like_fd is not None:
            like = os.fstat(like_fd)
            # Owner first: chown clears setuid/setgid, so the mode goes on after it.
            _keep_owner(fd, like, name)
            os.fchmod(fd, stat.S_IMODE(like.st_mode))
            _copy_xattrs(like_fd, fd)
        else:
            # A new file is readable by whoever can read its directory, whatever the umask.
            os.fchmod(fd, shared_mode(dfd, 0o644))
        os.fsync(fd)
    except BaseException:
        os.close(fd)
        unlink_quietly(dfd, tmp)
        raise
    os.close(fd)
    return tmp


def unlink_quietly(dfd: int, name: str) -> None:
    with contextlib.suppress(OSError):
        os.unlink(name, dir_fd=dfd)


def _put(dfd: int, name: str, data: bytes, like_fd: int | None) -> None:
    """`data` renamed over `name` in `dfd` from a temp file (see write_temp), `dfd` fsynced."""
    tmp = write_temp(dfd, name, data, like_fd)
    try:
        os.replace(tmp, name, src_dir_fd=dfd, dst_dir_fd=dfd)
    except BaseException:
        unlink_quietly(dfd, tmp)
        raise
    os.fsync(dfd)


def _open_existing(dfd: int, name: str, path: Path | str) -> int | None:
    try:
        return open_regular(name, dir_fd=dfd)
    except NotRegular:
        raise not_plain(path) from None


def write_atomically(
    path: Path, data: bytes, like: os.stat_result | None = None, *, root: Path | None = None
) -> None:
    """Replace `path` with `data`, every directory from `root` (default: its own) down opened
    without following a symlink; a missing state directory on the way is made (and removed again
    when the write fails). With `like`, the file keeps the owner, mode and xattrs it had."""
    root = root or path.parent
    rel = path.relative_to(root).as_posix()
    rel_dir, name = os.path.dirname(rel), os.path.basename(rel)
    made = bool(rel_dir) and not os.path.lexists(root / rel_dir)
    dfd = open_dir(root, rel_dir, create=made)
    try:
        like_fd = _open_existing(dfd, name, path) if like is not None else None
        try:
            _put(dfd, name, data, like_fd)
        finally:
            if like_fd is not None:
                os.close(like_fd)
    except BaseException as exc:
        if made:  # only while still empty: a run that failed leaves no state directory
            with contextlib.suppress(OSError):
                os.rmdir(root / rel_dir)
        if isinstance(exc, OSError):
            raise env_error("write", path, exc) from None
        raise
    finally:
        os.close(dfd)


def unlink_in(root: Path, rel: str) -> None:
    """Remove `root/rel` (absent is fine), the directories on the way not followed if links."""
    dfd = open_dir_if_there(root, os.path.dirname(rel))
    if dfd is None:
        return
    try:
        os.unlink(os.path.basename(rel), dir_fd=dfd)
        os.fsync(dfd)
    except FileNotFoundError:
        pass
    except OSError as exc:
        raise env_error("remove", root / rel, exc) from None
    finally:
        os.close(dfd)


def _snapshot(st: os.stat_result) -> tuple[int, int, int, int]:
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


_RENAME_EXCHANGE = 2  # linux/fs.h
_renameat2: list[Callable[..., int] | None] = []  # found on first use; [None]: none here


def exchange(dfd: int, a: str, b: str) -> bool:
    """Swap the names `a` and `b` in `dfd` atomically (Linux renameat2 RENAME_EXCHANGE); False
    where the system or filesystem cannot (the caller then renames plainly)."""
    if not _renameat2:
        try:
            found = ctypes.CDLL(None, use_errno=True).renameat2
            c_int, c_path = ctypes.c_int, ctypes.c_char_p
            found.argtypes = [c_int, c_path, c_int, c_path, ctypes.c_uint]
            _renameat2.append(found)
        except (OSError, AttributeError):
            _renameat2.append(None)
    call = _renameat2[0]
    if call is None:
        return False
    if call(dfd, os.fsencode(a), dfd, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP, errno.EOPNOTSUPP):
        _renameat2[0] = None  # this kernel or filesystem has no exchange: do not ask again
        return False
    raise OSError(err, os.strerror(err), b)


def _look(dfd: int, name: str) -> tuple[int, int, int, int] | None:
    try:
        return _snapshot(os.stat(name, dir_fd=dfd, follow_symlinks=False))
    except FileNotFoundError:
        return None


def changed(path: Path) -> ConcurrentChange:
    return ConcurrentChange(
        f"{path} changed while k3patch was working on it; nothing was kept, run again"
    )


def replace_checked(
    root: Path,
    rel: str,
    before: bytes | None,
    after: bytes | None,
    *,
    about_to_rename: Callable[[], None],
    notes: list[str],
) -> None:
    """Replace `root/rel`, which must hold `before` (None: absent), with `after` (None: remove
    it). Raises ConcurrentChange, with the other writer's file in place, when the file is not
    `before` when read, is not the same file right before the rename, or was renamed in after
    that last look (seen through an atomic exchange, where the system has one).
    `about_to_rename` is called right before the file is changed."""
    path = root / rel
    dfd = open_dir(root, os.path.dirname(rel))
    name = os.path.basename(rel)
    old_fd: int | None = None
    try:
        old_fd = _open_existing(dfd, name, path)
        if (None if old_fd is None else read_fd(old_fd)) != before:
            raise changed(path)
        old = None if old_fd is None else os.fstat(old_fd)
        seen = None if old is None else _snapshot(old)
        if old is not None and old.st_nlink > 1:
            notes.append(
                f"note: vllm/{rel} had {old.st_nlink} hard links; the other names keep the old "
                "content"
            )
        tmp = None if after is None else write_temp(dfd, name, after, old_fd)
        if _look(dfd, name) != seen:  # the last look: another writer's edit must be kept
            if tmp is not None:
                unlink_quietly(dfd, tmp)
            raise changed(path)
        about_to_rename()
        if tmp is None:
            os.unlink(name, dir_fd=dfd)
        elif old_fd is None or not exchange(dfd, tmp, name):
            os.replace(tmp, name, src_dir_fd=dfd, dst_dir_fd=dfd)
        else:
            # Swapped: `tmp` now names what stood at `name`. Anything but the file we read
            # means another writer renamed its own file in after our last look.
            if _look(dfd, tmp) != seen:
                exchange(dfd, tmp, name)  # theirs back in place, ours out again
                unlink_quietly(dfd, tmp)
                os.fsync(dfd)
                raise ConcurrentChange(
                    f"{path} was replaced by another process while k3patch replaced it; "
                    "its file was put back and nothing of k3patch's was kept, run again"
                )
            unlink_quietly(dfd, tmp)
        os.fsync(dfd)
        if old_fd is not None and _snapshot(os.fstat(old_fd)) != seen:
            # An edit landed on the old file in the last instant: put it back, report it.
            _put(dfd, name, os.pread(old_fd, os.fstat(old_fd).st_size + 1, 0), old_fd)
            raise ConcurrentChange(
                f"{path} was written by another process while k3patch replaced it; its "
                "edit was put back and nothing of k3patch's was kept, run again"
            )
    except OSError as exc:
        raise env_error("write", path, exc) from None
    finally:
        if old_fd is not None:
            os.close(old_fd)
        os.close(dfd)
