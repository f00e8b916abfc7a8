"""The only module that writes into a vLLM tree.

A commit replaces a set of files as one transaction:
1. every before- and after-image is stored as a content-addressed blob in `.k3patch/blobs/`;
2. a journal naming each file with its before and after hash is written atomically;
3. each file is replaced atomically (temp file in the same directory, fsync, owner, mode and
   xattrs kept, rename, directory fsync), after checking, right before the rename, that it still
   holds its before-image;
4. `__pycache__` is brought in line with each new source;
5. the journal is removed.
A run that dies anywhere in 3-5 leaves the journal; the next run, under the lock, rolls every
journalled file back to its before-image (`recover`), then does its own work from a consistent
tree. The state record is one of the journalled files, so it rolls back with the sources.
Concurrent runs serialise on an flock of the `.k3patch` directory.

Nothing on disk is trusted. Every directory from the package dir down to a file is opened with
O_NOFOLLOW and every file is created with O_CREAT|O_EXCL|O_NOFOLLOW under an unpredictable name,
so a planted symlink can never redirect a write or a delete outside the tree; a journal naming
anything but a registered target is damaged, never obeyed; only blob-named regular files are
ever pruned.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import secrets
import stat
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from k3patch.errors import ConcurrentChange
from k3patch.lock import EnvironmentProblem, env_error, locked
from k3patch.pycache import check_cache_dir, sync_pycache
from k3patch.safefs import _READ_FLAGS, _not_plain, _read_fd, open_dir, read_regular

__all__ = ["EnvironmentProblem", "FileEdit", "Transaction", "locked", "write_atomically"]

JOURNAL = "journal.json"
BLOBS = "blobs"
TMP_MARK = ".k3patch-tmp."
_LITTER = re.compile(r"^\..+\.k3patch-tmp\.[0-9a-f]+$")
_BLOB = re.compile(r"^[0-9a-f]{64}$")

FaultHook = Callable[[str], None]


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@dataclass(frozen=True)
class FileEdit:
    """Replace `rel` (relative to the package dir) holding `before` with `after`.
    None means the file is absent (before) or is to be removed (after)."""

    rel: str
    before: bytes | None
    after: bytes | None


def _copy_xattrs(src_fd: int, dst_fd: int) -> None:
    """Security labels and ACLs (system.posix_acl_access) travel with the file."""
    try:
        names = os.listxattr(src_fd)
    except OSError:
        return
    for name in names:
        try:
            os.setxattr(dst_fd, name, os.getxattr(src_fd, name))
        except OSError:
            pass


def _new_temp(dfd: int, name: str) -> tuple[str, int]:
    for _ in range(16):
        tmp = f".{name}{TMP_MARK}{secrets.token_hex(8)}"
        try:
            flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
            return tmp, os.open(tmp, flags, 0o600, dir_fd=dfd)
        except FileExistsError:
            continue
    raise FileExistsError(errno.EEXIST, "no free temp name", name)


def _write_temp(dfd: int, name: str, data: bytes, like_fd: int | None) -> str:
    tmp, fd = _new_temp(dfd, name)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        if like_fd is not None:
            like = os.fstat(like_fd)
            # Owner first: chown clears setuid/setgid, so the mode goes on after it.
            if (like.st_uid, like.st_gid) != (os.getuid(), os.getgid()):
                os.fchown(fd, like.st_uid, like.st_gid)
            os.fchmod(fd, stat.S_IMODE(like.st_mode))
            _copy_xattrs(like_fd, fd)
        else:
            umask = os.umask(0)
            os.umask(umask)
            os.fchmod(fd, 0o644 & ~umask)
        os.fsync(fd)
    except BaseException:
        os.close(fd)
        _unlink_quietly(dfd, tmp)
        raise
    os.close(fd)
    return tmp


def _unlink_quietly(dfd: int, name: str) -> None:
    try:
        os.unlink(name, dir_fd=dfd)
    except OSError:
        pass


def write_atomically(
    path: Path, data: bytes, like: os.stat_result | None = None, *, root: Path | None = None
) -> None:
    """Replace `path` with `data` so that a reader sees the old or the new file, never a mix.
    Every directory from `root` (default: the file's own directory) down is checked."""
    root = root or path.parent
    rel = path.relative_to(root).as_posix()
    dfd = open_dir(root, os.path.dirname(rel))
    name = os.path.basename(rel)
    try:
        like_fd = _open_existing(dfd, name, path) if like is not None else None
        try:
            tmp = _write_temp(dfd, name, data, like_fd)
        finally:
            if like_fd is not None:
                os.close(like_fd)
        try:
            os.replace(tmp, name, src_dir_fd=dfd, dst_dir_fd=dfd)
        except BaseException:
            _unlink_quietly(dfd, tmp)
            raise
        os.fsync(dfd)
    except OSError as exc:
        raise env_error("write", path, exc) from None
    finally:
        os.close(dfd)


def _open_existing(dfd: int, name: str, path: Path | str) -> int | None:
    try:
        fd = os.open(name, _READ_FLAGS, dir_fd=dfd)
    except FileNotFoundError:
        return None
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.EISDIR):
            raise _not_plain(path) from None
        raise
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise _not_plain(path)
    return fd


def _snapshot(st: os.stat_result) -> tuple[int, int, int, int]:
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


_RENAME_EXCHANGE = 2  # linux/fs.h
_renameat2: Any = None


def _exchange(dfd: int, a: str, b: str) -> bool:
    """Swap the names `a` and `b` in `dfd` atomically (Linux renameat2 RENAME_EXCHANGE). False
    where the system cannot (no such call, or a filesystem that refuses it): the caller then
    renames plainly, with only its last look before the rename to protect another writer."""
    global _renameat2
    if _renameat2 is None:
        try:
            import ctypes

            call = ctypes.CDLL(None, use_errno=True).renameat2
            c_int, c_path = ctypes.c_int, ctypes.c_char_p
            call.argtypes = [c_int, c_path, c_int, c_path, ctypes.c_uint]
            _renameat2 = call
        except (OSError, AttributeError):
            _renameat2 = False
    if not _renameat2:
        return False
    import ctypes

    if _renameat2(dfd, os.fsencode(a), dfd, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP, errno.EOPNOTSUPP):
        _renameat2 = False  # this kernel or filesystem has no exchange: do not ask again
        return False
    raise OSError(err, os.strerror(err), b)


def _is_same_file(dfd: int, name: str, seen: tuple[int, int, int, int] | None) -> bool:
    try:
        return _snapshot(os.stat(name, dir_fd=dfd, follow_symlinks=False)) == seen
    except FileNotFoundError:
        return False


class Transaction:
    """Commits and recovers edits of one tree. Use inside `locked(state_dir)`."""

    def __init__(
        self,
        package_dir: Path,
        fault: FaultHook | None = None,
        targets: frozenset[str] | None = None,
    ) -> None:
        self.package_dir = package_dir
        self.state_dir = package_dir / ".k3patch"
        self.fault = fault or _fault_from_environment
        self._targets = targets
        self.notes: list[str] = []

    @property
    def allowed(self) -> frozenset[str]:
        """The paths a journal may name: the registry's targets and k3patch's own record."""
        from k3patch.state import STATE_REL, registered_targets

        if self._targets is None:
            self._targets = registered_targets()
        return self._targets | {STATE_REL}

    # -- blobs ---------------------------------------------------------------------------
    def blob_path(self, digest: str) -> Path:
        return self.state_dir / BLOBS / digest

    def _blob_dir(self, create: bool = False) -> int | None:
        try:
            return open_dir(self.package_dir, f".k3patch/{BLOBS}", create=create)
        except EnvironmentProblem:
            if not create and not os.path.lexists(self.state_dir / BLOBS):
                return None
            raise

    def store_blob(self, data: bytes) -> str:
        digest = sha256(data)
        dfd = self._blob_dir(create=True)
        assert dfd is not None
        try:
            if read_regular(digest, what="saved copy", dir_fd=dfd) != data:
                tmp = _write_temp(dfd, digest, data, None)
                os.replace(tmp, digest, src_dir_fd=dfd, dst_dir_fd=dfd)
                os.fsync(dfd)
        except OSError as exc:
            raise env_error("write", self.blob_path(digest), exc) from None
        finally:
            os.close(dfd)
        return digest

    def load_blob(self, digest: str) -> bytes:
        if not _BLOB.match(digest):
            raise EnvironmentProblem(f"{digest!r} is not a saved-copy name; the record is damaged")
        dfd = self._blob_dir()
        data = None if dfd is None else read_regular(digest, what="saved copy", dir_fd=dfd)
        if dfd is not None:
            os.close(dfd)
        if data is None or sha256(data) != digest:
            raise EnvironmentProblem(
                f"the saved copy {self.blob_path(digest)} is missing or damaged; "
                "reinstall vLLM to get the original files back"
            )
        return data

    def blob_names(self) -> list[str]:
        dfd = self._blob_dir()
        if dfd is None:
            return []
        try:
            return [
                e.name
                for e in os.scandir(dfd)
                if _BLOB.match(e.name) and e.is_file(follow_symlinks=False)
            ]
        finally:
            os.close(dfd)

    def prune_blobs(self, keep: set[str]) -> None:
        """Only blob-named regular files are removed; anything else in blobs/ is left alone."""
        dfd = self._blob_dir()
        if dfd is None:
            return
        try:
            for entry in os.scandir(dfd):
                if entry.name in keep or not _BLOB.match(entry.name):
                    continue
                if entry.is_file(follow_symlinks=False):
                    os.unlink(entry.name, dir_fd=dfd)
        except OSError as exc:
            raise env_error("remove saved copies in", self.state_dir / BLOBS, exc) from None
        finally:
            os.close(dfd)

    # -- commit --------------------------------------------------------------------------
    def commit(self, edits: list[FileEdit], op: str) -> list[str]:
        """Apply all edits or none. Returns the pycache actions taken (and notes)."""
        allowed = self.allowed
        for edit in edits:
            if edit.rel not in allowed:
                raise EnvironmentProblem(f"refusing to write {edit.rel!r}: not a k3patch target")
            os.close(open_dir(self.package_dir, os.path.dirname(edit.rel)))
            if edit.rel.endswith(".py"):
                check_cache_dir(self.package_dir / edit.rel)
        # Write-ahead: the journal goes first, so that a run killed while storing blobs leaves
        # a journal whose recovery prunes them; saved copies with no journal and no record
        # can then only be originals whose record was lost, and revert keeps them.
        entries = [
            {
                "path": edit.rel,
                "before": None if edit.before is None else sha256(edit.before),
                "after": None if edit.after is None else sha256(edit.after),
            }
            for edit in edits
        ]
        journal = {"op": op, "pid": os.getpid(), "time": time.time(), "files": entries}
        self._write_state_file(JOURNAL, json.dumps(journal, indent=1).encode())
        actions: list[str] = []
        written: set[str] = set()
        try:
            self.fault("journal-written")
            for edit in edits:
                for data in (edit.before, edit.after):
                    if data is not None:
                        self.store_blob(data)
            self.fault("blobs-written")
            for edit in edits:
                self._replace(edit, written)
                self.fault(f"replaced:{edit.rel}")
            for edit in edits:
                if edit.rel.endswith(".py"):
                    actions += self._sync_pycache(self.package_dir / edit.rel)
            self.fault("pycache-synced")
        except BaseException:
            # Roll back what this run wrote; if that fails too the journal stays for the next run.
            try:
                self.recover(only=written)
            except Exception:
                pass
            raise
        self._remove_state_file(JOURNAL)
        self.fault("journal-removed")
        return actions + self.notes

    def _replace(self, edit: FileEdit, written: set[str]) -> None:
        path = self.package_dir / edit.rel
        dfd = open_dir(self.package_dir, os.path.dirname(edit.rel))
        name = os.path.basename(edit.rel)
        old_fd: int | None = None
        try:
            old_fd = _open_existing(dfd, name, path)
            current = None if old_fd is None else _read_fd(old_fd)
            if current != edit.before:
                raise _changed(path)
            seen = None if old_fd is None else _snapshot(os.fstat(old_fd))
            if old_fd is not None and os.fstat(old_fd).st_nlink > 1:
                self.notes.append(
                    f"note: vllm/{edit.rel} had {os.fstat(old_fd).st_nlink} hard links; the "
                    "other names keep the old content"
                )
            tmp = None if edit.after is None else _write_temp(dfd, name, edit.after, old_fd)
            # The last look before the rename: another writer's edit must not be overwritten.
            try:
                now = _snapshot(os.stat(name, dir_fd=dfd, follow_symlinks=False))
            except FileNotFoundError:
                now = None
            if now != seen:
                if tmp is not None:
                    _unlink_quietly(dfd, tmp)
                raise _changed(path)
            self.fault(f"renaming:{edit.rel}")
            written.add(edit.rel)
            if tmp is None:
                os.unlink(name, dir_fd=dfd)
            elif old_fd is None or not _exchange(dfd, tmp, name):
                os.replace(tmp, name, src_dir_fd=dfd, dst_dir_fd=dfd)
            else:
                # Swapped: `tmp` now names what stood at `name`. Anything but the file we read
                # means another writer renamed its own file in after our last look.
                if not _is_same_file(dfd, tmp, seen):
                    _exchange(dfd, tmp, name)  # theirs back in place, ours out again
                    _unlink_quietly(dfd, tmp)
                    os.fsync(dfd)
                    written.discard(edit.rel)
                    raise ConcurrentChange(
                        f"{path} was replaced by another process while k3patch replaced it; "
                        "its file was put back and nothing of k3patch's was kept, run again"
                    )
                _unlink_quietly(dfd, tmp)
            os.fsync(dfd)
            if old_fd is not None and _snapshot(os.fstat(old_fd)) != seen:
                # An edit landed on the old file in the last instant: put it back, report it.
                theirs = os.pread(old_fd, os.fstat(old_fd).st_size + 1, 0)
                tmp = _write_temp(dfd, name, theirs, old_fd)
                os.replace(tmp, name, src_dir_fd=dfd, dst_dir_fd=dfd)
                os.fsync(dfd)
                written.discard(edit.rel)
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

    def _write_state_file(self, name: str, data: bytes) -> None:
        write_atomically(self.state_dir / name, data, root=self.package_dir)

    def _remove_state_file(self, name: str) -> None:
        self._unlink_target(f".k3patch/{name}")

    def remove_state_dir(self) -> None:
        """The record, an empty blobs/ and `.k3patch` itself; anything else is left where it is.
        Called under the lock: the directory removed is the one this run holds."""
        self._remove_state_file("state.json")
        dfd = open_dir(self.package_dir, ".k3patch")
        try:
            os.rmdir(BLOBS, dir_fd=dfd)
        except FileNotFoundError:
            pass
        except OSError:
            return
        finally:
            os.close(dfd)
        try:
            os.rmdir(self.state_dir)
        except OSError:
            pass

    def _sync_pycache(self, source: Path) -> list[str]:
        try:
            return [f"{source.name}: {a}" for a in sync_pycache(source)]
        except OSError as exc:
            raise env_error("update the bytecode of", source, exc) from None

    # -- recovery ------------------------------------------------------------------------
    def pending_journal(self) -> dict[str, Any] | None:
        """The journal of an interrupted commit, checked entry by entry; None when there is
        none. A journal that names anything but a registered target is damaged (RecordDamaged)."""
        from k3patch.state import _damaged, confined, is_digest

        data = read_regular(self.state_dir / JOURNAL, what="journal")
        if data is None:
            return None
        where = str(self.state_dir / JOURNAL)
        try:
            loaded = json.loads(data)
        except (ValueError, RecursionError):
            raise _damaged(where, "it is not valid JSON (truncated?)") from None
        files = loaded.get("files") if isinstance(loaded, dict) else None
        if not isinstance(files, list) or not isinstance(loaded.get("op"), str):
            raise _damaged(where, "it lacks op or files")
        allowed = self.allowed
        for entry in files:
            if not isinstance(entry, dict) or not confined(
                entry.get("path"), self.package_dir, allowed
            ):
                raise _damaged(where, f"it names {entry!r}, not a k3patch target")
            for key in ("before", "after"):
                value = entry.get(key)
                if value is not None and not is_digest(value):
                    raise _damaged(where, f"{key} of {entry.get('path')!r} is not a sha256")
        return {"op": loaded["op"], "files": files}

    def recover(self, only: set[str] | None = None) -> list[str]:
        """Roll an interrupted commit back to its before-images. Returns what was done.
        `only`: the files this process wrote (an in-process rollback leaves the others alone)."""
        journal = self.pending_journal()
        done: list[str] = []
        if journal is not None:
            files = [e for e in journal["files"] if only is None or e["path"] in only]
            for entry in files:
                path = self.package_dir / entry["path"]
                dfd = open_dir(self.package_dir, os.path.dirname(entry["path"]))
                try:
                    current = read_regular(os.path.basename(entry["path"]), dir_fd=dfd)
                finally:
                    os.close(dfd)
                current_hash = None if current is None else sha256(current)
                if current_hash == entry["before"]:
                    continue
                if current_hash != entry["after"]:
                    raise EnvironmentProblem(
                        f"{path} was changed by something else during an interrupted k3patch "
                        f"run (now {current_hash and current_hash[:12]}, k3patch wrote "
                        f"{entry['after'] and entry['after'][:12]}, before "
                        f"{entry['before'] and entry['before'][:12]}); restore it (reinstall "
                        f"vLLM) and remove {self.state_dir / JOURNAL}"
                    )
                if entry["before"] is None:
                    self._unlink_target(entry["path"])
                else:
                    write_atomically(
                        path,
                        self.load_blob(entry["before"]),
                        like=os.stat(path, follow_symlinks=False) if current is not None else None,
                        root=self.package_dir,
                    )
                done.append(f"rolled back {entry['path']}")
            for entry in files:
                if entry["path"].endswith(".py"):
                    self._sync_pycache(self.package_dir / entry["path"])
            self._remove_state_file(JOURNAL)
            self._prune_to_record()
        done += self.remove_litter(journal)
        return done

    def _prune_to_record(self) -> None:
        """After a rollback: the saved copies the (rolled back) record needs, and no others."""
        from k3patch.state import load

        try:
            record = load(self.state_dir, self.allowed, self.package_dir)
        except EnvironmentProblem:
            return  # a damaged record keeps every saved copy
        keep = set() if record is None else {fs.original for fs in record.files.values()}
        self.prune_blobs({digest for digest in keep if digest})

    def _unlink_target(self, rel: str) -> None:
        dfd = open_dir(self.package_dir, os.path.dirname(rel))
        try:
            os.unlink(os.path.basename(rel), dir_fd=dfd)
            os.fsync(dfd)
        except FileNotFoundError:
            pass
        except OSError as exc:
            raise env_error("remove", self.package_dir / rel, exc) from None
        finally:
            os.close(dfd)

    def remove_litter(self, journal: dict[str, Any] | None) -> list[str]:
        """Temp files left by a killed run, next to the state files and the journalled files:
        only regular files named like k3patch's temp files, in directories reached without
        following a symlink."""
        dirs = {".k3patch", f".k3patch/{BLOBS}"}
        for entry in journal["files"] if journal is not None else []:
            dirs.add(os.path.dirname(entry["path"]))
        removed = []
        for rel_dir in sorted(dirs):
            try:
                dfd = open_dir(self.package_dir, rel_dir)
            except EnvironmentProblem:
                continue
            try:
                for entry in os.scandir(dfd):
                    if _LITTER.match(entry.name) and entry.is_file(follow_symlinks=False):
                        os.unlink(entry.name, dir_fd=dfd)
                        removed.append(f"removed {self.package_dir / rel_dir / entry.name}")
            finally:
                os.close(dfd)
        return removed


def _changed(path: Path) -> ConcurrentChange:
    return ConcurrentChange(
        f"{path} changed while k3patch was working on it; nothing was kept, run again"
    )


def _fault_from_environment(step: str) -> None:
    """Crash tests set K3PATCH_TEST_CRASH_AT to a step name to make the process die there."""
    target = os.environ.get("K3PATCH_TEST_CRASH_AT")
    if target and (step == target or (target.endswith("*") and step.startswith(target[:-1]))):
        os._exit(137)
