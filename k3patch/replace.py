"""Replacing one file inside the tree so that a reader sees the old file or the new, never a mix:
a temp file beside it (O_CREAT|O_EXCL|O_NOFOLLOW under an unpredictable name, so a planted link is
never written through), fsynced, with the owner, mode and xattrs of the file it replaces, renamed
over it, never over another writer's edit (see replace_checked).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import functools
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
    give_to_owner_of,
    not_plain,
    open_dir,
    open_dir_if_there,
    open_regular,
    read_file,
    read_in,
    shared_mode,
)

# What `write_temp` names a temp file: only files named so are ever removed as litter.
LITTER = re.compile(r"^\..+\.k3patch-tmp\.[0-9a-f]+$")


def _copy_xattrs(src_fd: int, dst_fd: int) -> None:
    """Security labels and ACLs (system.posix_acl_access) travel with the file."""
    with contextlib.suppress(OSError):
        for name in os.listxattr(src_fd):
            with contextlib.suppress(OSError):
                os.setxattr(dst_fd, name, os.getxattr(src_fd, name))


def _keep_owner(fd: int, like: os.stat_result, name: str) -> str | None:
    """Give the temp file `fd` the owner and group of `like`, changing only what differs (in a
    setgid directory there may be nothing to change, and no chown to be refused). A group this
    process may not give a file it owns is not kept, as pip or an editor would not keep it
    either: returned as a warning. Any other chown refused is an EnvironmentProblem."""
    have = os.fstat(fd)
    uid = like.st_uid if like.st_uid != have.st_uid else -1
    gid = like.st_gid if like.st_gid != have.st_gid else -1
    if uid == gid == -1:
        return None
    try:
        os.fchown(fd, uid, gid)
    except PermissionError:
        if uid == -1 and like.st_uid == os.geteuid():
            return (
                f"warning: the files k3patch replaced could not keep their group {gid} (uid "
                f"{os.geteuid()} is not in it); they now have group {have.st_gid}, as pip or "
                "an editor would leave them"
            )
        who = f"uid {os.geteuid()} (groups {', '.join(map(str, os.getgroups()))})"
        raise EnvironmentProblem(
            f"cannot keep the owner and group {like.st_uid}:{like.st_gid} of {name}: {who} "
            f"may not give a file {'owner ' + str(uid) if uid != -1 else 'group ' + str(gid)}"
            f"{' (not one of its groups)' if uid == -1 else ''}. Run as root or as a member of "
            "that group, or make the directory setgid to that group"
        ) from None
    return None


def write_temp(
    dfd: int, name: str, data: bytes, like_fd: int | None, notes: list[str] | None = None
) -> str:
    """A new temp file beside `name` in `dfd` holding `data`, fsynced, with the owner, mode and
    xattrs of `like_fd` (or the directory's owner and read bits, see shared_mode); returns its
    name. A group that could not be kept is a warning appended to `notes`."""
    tmp = f".{name}.k3patch-tmp.{secrets.token_hex(8)}"
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    fd = os.open(tmp, flags, 0o600, dir_fd=dfd)
    try:
        _fill(fd, dfd, name, data, like_fd, notes)
    except BaseException:
        unlink_quietly(dfd, tmp)  # a close that fails (EIO, ENOSPC on NFS) included
        raise
    return tmp


def _fill(
    fd: int, dfd: int, name: str, data: bytes, like_fd: int | None, notes: list[str] | None
) -> None:
    """write_temp's work on the new file `fd`, which it closes."""
    try:
        with open(fd, "wb", closefd=False) as file:
            file.write(data)
        if like_fd is not None:
            like = os.fstat(like_fd)
            # Owner first: chown clears setuid/setgid, so the mode goes on after it.
            warning = _keep_owner(fd, like, name)
            if warning and notes is not None and warning not in notes:
                notes.append(warning)
            os.fchmod(fd, stat.S_IMODE(like.st_mode))
            _copy_xattrs(like_fd, fd)
        else:
            # A new file is readable by whoever can read its directory, whatever the umask.
            give_to_owner_of(fd, dfd)
            os.fchmod(fd, shared_mode(dfd, 0o644))
        os.fsync(fd)
    finally:
        os.close(fd)


def unlink_quietly(dfd: int, name: str) -> None:
    with contextlib.suppress(OSError):
        os.unlink(name, dir_fd=dfd)


def write_atomically(path: Path, data: bytes, *, root: Path) -> None:
    """Replace `path` with `data`, whatever it holds now (see replace_checked); the state
    directories missing on the way from `root` are made."""
    rel = path.relative_to(root).as_posix()
    os.close(open_dir(root, os.path.dirname(rel), create=True))
    replace_checked(root, rel, read_in(root, rel), data)


def unlink_in(root: Path, rel: str, *, rmdir: bool = False, durable: bool = True) -> None:
    """Remove the file (with `rmdir`: the empty directory) `root/rel`, absent is fine, the
    directories on the way not followed if links; a directory that is not empty is left as it
    is. Not `durable`: a sync of the directory that fails after the removal is no error."""
    dfd = open_dir_if_there(root, os.path.dirname(rel))
    if dfd is None:
        return
    try:
        (os.rmdir if rmdir else os.unlink)(os.path.basename(rel), dir_fd=dfd)
        try:
            os.fsync(dfd)
        except OSError:
            if durable:
                raise
    except FileNotFoundError:
        pass
    except OSError as exc:
        if rmdir and exc.errno in (errno.ENOTEMPTY, errno.EEXIST):
            return  # `finally` closes dfd
        raise env_error("remove", root / rel, exc) from None
    finally:
        os.close(dfd)


def _snapshot(st: os.stat_result) -> tuple[int, int, int, int]:
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


_RENAME_EXCHANGE = 2  # linux/fs.h


@functools.cache
def _renameat2() -> Callable[..., int] | None:
    try:
        found = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        return None
    found.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    return found  # type: ignore[no-any-return]


def exchange(dfd: int, a: str, b: str) -> bool:
    """Swap the names `a` and `b` in `dfd` atomically (Linux renameat2 RENAME_EXCHANGE); False
    where the system or filesystem cannot (the caller then renames plainly)."""
    call = _renameat2()
    if call is None:
        return False
    if call(dfd, os.fsencode(a), dfd, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
        return False
    raise OSError(err, os.strerror(err), b)


def _contents(fd: int) -> bytes:
    return os.pread(fd, os.fstat(fd).st_size + 1, 0)


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
    about_to_rename: Callable[[], None] = lambda: None,
    kept: list[str] | None = None,
) -> list[str]:
    """Replace `root/rel`, which must hold `before` (None: absent), with `after` (None: remove
    it); returns the notes for the report (other hard links keep the old content). Raises
    ConcurrentChange, with the other writer's file in place, when the file is not `before`
    when read, is not the same file right before the rename, or was renamed in after that last
    look (seen through an atomic exchange, where the system has one). `about_to_rename` is
    called right before the file is changed. With `kept`, the old file is not removed but kept
    beside it under a temp name, appended to `kept` (relative to `root`), so that a rollback is
    a rename back and needs no space (see `put_back`)."""
    path = root / rel
    dfd = open_dir(root, os.path.dirname(rel))
    name = os.path.basename(rel)
    old_fd: int | None = None
    try:
        try:
            old_fd = open_regular(name, dir_fd=dfd)
        except NotRegular:
            raise not_plain(path) from None
        # The snapshot before the read: an edit landing between them shows at the last look.
        old = None if old_fd is None else os.fstat(old_fd)
        seen = None if old is None else _snapshot(old)
        if (None if old_fd is None else _contents(old_fd)) != before:
            raise changed(path)
        notes: list[str] = []
        if old is not None and old.st_nlink > 1:
            notes.append(
                f"note: vllm/{rel} had {old.st_nlink} hard links; the other names keep the old "
                "content"
            )
        tmp = None if after is None else write_temp(dfd, name, after, old_fd, notes)
        keep = None
        if kept is not None and old_fd is not None:
            keep = f".{name}.k3patch-tmp.{secrets.token_hex(8)}"
        ours = [n for n in (tmp,) if n]  # this run's temp names, until the rename settles them
        try:
            if _look(dfd, name) != seen:  # the last look: another writer's edit must be kept
                raise changed(path)
            about_to_rename()
            if tmp is None:
                if keep is None:
                    os.unlink(name, dir_fd=dfd)
                else:
                    os.rename(name, keep, src_dir_fd=dfd, dst_dir_fd=dfd)
            elif old_fd is None or not exchange(dfd, tmp, name):
                if keep is not None:
                    try:  # the old inode under a second name: the rename then frees nothing
                        os.link(name, keep, src_dir_fd=dfd, dst_dir_fd=dfd, follow_symlinks=False)
                        ours.append(keep)
                    except OSError:
                        keep = None  # a rollback of this file then writes the saved copy
                os.replace(tmp, name, src_dir_fd=dfd, dst_dir_fd=dfd)
                ours = []
            else:
                ours = []  # swapped: `tmp` now names what stood at `name`
                # Anything but the file we read means another writer renamed its own file in
                # after our last look. A look that fails cannot tell: everything back as it
                # stood, as for another writer's file.
                failed: OSError | None = None
                try:
                    moved = _look(dfd, tmp)
                except OSError as exc:
                    moved, failed = None, exc
                if failed is not None or moved != seen:
                    exchange(dfd, tmp, name)  # theirs back in place, ours out again
                    unlink_quietly(dfd, tmp)
                    if failed is not None:
                        raise failed
                    os.fsync(dfd)
                    raise ConcurrentChange(
                        f"{path} was replaced by another process while k3patch replaced it; "
                        "its file was put back and nothing of k3patch's was kept, run again"
                    )
                if keep is None:
                    unlink_quietly(dfd, tmp)
                else:
                    try:
                        os.rename(tmp, keep, src_dir_fd=dfd, dst_dir_fd=dfd)
                    except OSError:
                        unlink_quietly(dfd, tmp)  # the file we read: a rollback writes its copy
                        raise
        except BaseException:
            for leftover in ours:  # the new file never took its place: none of it stays
                unlink_quietly(dfd, leftover)
            raise
        if kept is not None and keep is not None:
            kept.append(os.path.join(os.path.dirname(rel), keep))
        os.fsync(dfd)
        if old_fd is not None and _snapshot(os.fstat(old_fd)) != seen:
            # An edit landed on the old file in the last instant: put it back, report it.
            if keep is not None:
                os.replace(keep, name, src_dir_fd=dfd, dst_dir_fd=dfd)  # the old inode itself
                assert kept is not None
                kept.pop()
            else:
                tmp = write_temp(dfd, name, _contents(old_fd), old_fd)
                os.replace(tmp, name, src_dir_fd=dfd, dst_dir_fd=dfd)
            os.fsync(dfd)
            raise ConcurrentChange(
                f"{path} was written by another process while k3patch replaced it; its "
                "edit was put back and nothing of k3patch's was kept, run again"
            )
    except OSError as exc:
        raise env_error("remove" if after is None else "write", path, exc) from None
    finally:
        if old_fd is not None:
            os.close(old_fd)
        os.close(dfd)
    return notes


def put_back(root: Path, rel: str, keep: str, now: bytes | None) -> None:
    """Undo a `replace_checked` that kept the old file as `keep`: rename it back over `rel`,
    which must still hold `now` (what k3patch wrote; None: k3patch removed it). A rename needs
    no space, so a rollback on a full disk cannot fail half way for the want of it."""
    path = root / rel
    dfd = open_dir(root, os.path.dirname(rel))
    name = os.path.basename(rel)
    try:
        try:
            current = read_file(name, dir_fd=dfd)
        except NotRegular:
            raise not_plain(path) from None
        if current != now:
            raise changed(path)
        os.replace(os.path.basename(keep), name, src_dir_fd=dfd, dst_dir_fd=dfd)
        os.fsync(dfd)
    except OSError as exc:
        raise env_error("write", path, exc) from None
    finally:
        os.close(dfd)
