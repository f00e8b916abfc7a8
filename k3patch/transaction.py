"""The only module that writes into a vLLM tree.

A commit replaces a set of files as one transaction:
1. every before- and after-image is stored as a content-addressed blob in `.k3patch/blobs/`;
2. a journal naming each file with its before and after hash is written atomically;
3. each file is replaced atomically (temp file in the same directory, fsync, mode and owner
   kept, rename, directory fsync), after checking it still holds its before-image;
4. `__pycache__` is brought in line with each new source;
5. the journal is removed.
A run that dies anywhere in 3-5 leaves the journal; the next run, under the lock, rolls every
journalled file back to its before-image (`recover`), then does its own work from a consistent
tree. The state record is one of the journalled files, so it rolls back with the sources.
Concurrent runs serialise on an flock of the `.k3patch` directory.
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from k3patch.lock import EnvironmentProblem, env_error, locked
from k3patch.pycache import sync_pycache

__all__ = ["EnvironmentProblem", "FileEdit", "Transaction", "locked", "write_atomically"]

JOURNAL = "journal.json"
BLOBS = "blobs"
TMP_MARK = ".k3patch-tmp."

FaultHook = Callable[[str], None]


class ConcurrentChange(Exception):
    """A file changed under us (not by k3patch); the commit was rolled back."""


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@dataclass(frozen=True)
class FileEdit:
    """Replace `rel` (relative to the package dir) holding `before` with `after`.
    None means the file is absent (before) or is to be removed (after)."""

    rel: str
    before: bytes | None
    after: bytes | None


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomically(path: Path, data: bytes, like: os.stat_result | None = None) -> None:
    """Replace `path` with `data` so that a reader sees the old or the new file, never a mix."""
    tmp = path.with_name(f".{path.name}{TMP_MARK}{os.getpid()}")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            view = memoryview(data)
            while view:
                written = os.write(fd, view)
                view = view[written:]
            os.fsync(fd)
        finally:
            os.close(fd)
        if like is not None:
            os.chmod(tmp, stat.S_IMODE(like.st_mode))
            if (like.st_uid, like.st_gid) != (os.getuid(), os.getgid()):
                os.chown(tmp, like.st_uid, like.st_gid)
        else:
            umask = os.umask(0)
            os.umask(umask)
            os.chmod(tmp, 0o644 & ~umask)
        os.replace(tmp, path)
        _fsync_dir(path.parent)
    except OSError as exc:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise env_error("write", path, exc) from None


def _remove(path: Path) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        return
    except OSError as exc:
        raise env_error("remove", path, exc) from None
    _fsync_dir(path.parent)


def _read(path: Path) -> bytes | None:
    try:
        return path.read_bytes()
    except FileNotFoundError:
        return None


class Transaction:
    """Commits and recovers edits of one tree. Use inside `locked(state_dir)`."""

    def __init__(self, package_dir: Path, fault: FaultHook | None = None) -> None:
        self.package_dir = package_dir
        self.state_dir = package_dir / ".k3patch"
        self.fault = fault or _fault_from_environment

    # -- blobs ---------------------------------------------------------------------------
    def blob_path(self, digest: str) -> Path:
        return self.state_dir / BLOBS / digest

    def store_blob(self, data: bytes) -> str:
        digest = sha256(data)
        path = self.blob_path(digest)
        if _read(path) != data:
            path.parent.mkdir(exist_ok=True)
            write_atomically(path, data)
        return digest

    def load_blob(self, digest: str) -> bytes:
        data = _read(self.blob_path(digest))
        if data is None or sha256(data) != digest:
            raise EnvironmentProblem(
                f"the saved copy {self.blob_path(digest)} is missing or damaged; "
                "reinstall vLLM to get the original files back"
            )
        return data

    def prune_blobs(self, keep: set[str]) -> None:
        blob_dir = self.state_dir / BLOBS
        if not blob_dir.is_dir():
            return
        for entry in blob_dir.iterdir():
            if entry.name not in keep:
                entry.unlink()

    # -- commit --------------------------------------------------------------------------
    def commit(self, edits: list[FileEdit], op: str) -> list[str]:
        """Apply all edits or none. Returns the pycache actions taken."""
        entries = []
        for edit in edits:
            entries.append(
                {
                    "path": edit.rel,
                    "before": None if edit.before is None else self.store_blob(edit.before),
                    "after": None if edit.after is None else self.store_blob(edit.after),
                }
            )
        self.fault("blobs-written")
        journal = {"op": op, "pid": os.getpid(), "time": time.time(), "files": entries}
        write_atomically(self.state_dir / JOURNAL, json.dumps(journal, indent=1).encode())
        actions: list[str] = []
        try:
            self.fault("journal-written")
            for edit in edits:
                path = self.package_dir / edit.rel
                if _read(path) != edit.before:
                    raise ConcurrentChange(
                        f"{path} changed while k3patch was working on it; nothing was kept, "
                        "run again"
                    )
                like = path.stat() if edit.before is not None else None
                if edit.after is None:
                    _remove(path)
                else:
                    write_atomically(path, edit.after, like)
                self.fault(f"replaced:{edit.rel}")
            for edit in edits:
                if edit.rel.endswith(".py"):
                    actions += self._sync_pycache(self.package_dir / edit.rel)
            self.fault("pycache-synced")
        except BaseException:
            # Roll back now; if that fails too the journal is still there for the next run.
            try:
                self.recover()
            except Exception:
                pass
            raise
        _remove(self.state_dir / JOURNAL)
        self.fault("journal-removed")
        return actions

    def _sync_pycache(self, source: Path) -> list[str]:
        try:
            return [f"{source.name}: {a}" for a in sync_pycache(source)]
        except OSError as exc:
            raise env_error("update the bytecode of", source, exc) from None

    # -- recovery ------------------------------------------------------------------------
    def pending_journal(self) -> dict[str, object] | None:
        data = _read(self.state_dir / JOURNAL)
        if data is None:
            return None
        try:
            loaded = json.loads(data)
        except ValueError:
            return {"op": "unknown", "files": []}
        return loaded if isinstance(loaded, dict) else {"op": "unknown", "files": []}

    def recover(self) -> list[str]:
        """Roll an interrupted commit back to its before-images. Returns what was done."""
        journal = self.pending_journal()
        done: list[str] = []
        if journal is not None:
            files = journal.get("files", [])
            assert isinstance(files, list)
            for entry in files:
                path = self.package_dir / entry["path"]
                current = _read(path)
                current_hash = None if current is None else sha256(current)
                if current_hash == entry["before"]:
                    continue
                if current_hash != entry["after"]:
                    raise EnvironmentProblem(
                        f"{path} was changed by something else during an interrupted k3patch "
                        f"run; restore it (reinstall vLLM) and remove {self.state_dir / JOURNAL}"
                    )
                if entry["before"] is None:
                    _remove(path)
                else:
                    like = path.stat() if current is not None else None
                    write_atomically(path, self.load_blob(entry["before"]), like)
                done.append(f"rolled back {entry['path']}")
            for entry in files:
                if entry["path"].endswith(".py"):
                    self._sync_pycache(self.package_dir / entry["path"])
            _remove(self.state_dir / JOURNAL)
        done += self.remove_litter(journal)
        return done

    def remove_litter(self, journal: dict[str, object] | None) -> list[str]:
        """Temp files left by a killed run, next to the state files and the journalled files."""
        dirs = {self.state_dir, self.state_dir / BLOBS}
        entries = journal.get("files", []) if journal is not None else []
        for entry in entries if isinstance(entries, list) else []:
            dirs.add((self.package_dir / entry["path"]).parent)
        removed = []
        for directory in dirs:
            if not directory.is_dir():
                continue
            for entry in directory.iterdir():
                if TMP_MARK in entry.name:
                    entry.unlink()
                    removed.append(f"removed {entry}")
        return removed


def _fault_from_environment(step: str) -> None:
    """Crash tests set K3PATCH_TEST_CRASH_AT to a step name to make the process die there."""
    target = os.environ.get("K3PATCH_TEST_CRASH_AT")
    if target and (step == target or (target.endswith("*") and step.startswith(target[:-1]))):
        os._exit(137)
