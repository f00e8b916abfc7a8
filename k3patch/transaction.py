"""The journalled commit: the only code that writes into a vLLM tree.

A commit replaces a set of files as one transaction:
1. a journal naming each file with its before and after hash is written atomically (state.py
   keeps its format, next to the record's);
2. every before- and after-image is stored as a content-addressed blob (blobs.py);
3. each file is replaced atomically after checking, right before the rename, that it still holds
   its before-image (replace.py);
4. `__pycache__` is brought in line with each new source;
5. the journal is removed.
A run that dies anywhere in 2-5 leaves the journal; the next run, under the lock, rolls every
journalled file back to its before-image (`recover`), then does its own work from a consistent
tree. The state record is one of the journalled files, so it rolls back with the sources.
Concurrent runs serialise on the tree's lock (lock.py).

Nothing on disk is trusted: a journal naming anything but a registered target is damaged, never
obeyed; directories are opened without following links (safefs.py); only blob-named regular files
are ever pruned and only temp-named regular files removed as litter.
"""

from __future__ import annotations

import hashlib
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from k3patch import state
from k3patch.blobs import BLOBS, Blobs
from k3patch.errors import ConcurrentChange, EnvironmentProblem
from k3patch.pycache import check_cache_dir, sync_pycache
from k3patch.replace import LITTER, replace_checked, unlink_in, write_atomically
from k3patch.safefs import env_error, open_dir, open_dir_if_there, read_regular

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


class Transaction:
    """Commits and recovers edits of one tree. Use inside `lock.locked(package_dir)`."""

    def __init__(
        self,
        package_dir: Path,
        fault: FaultHook | None = None,
        targets: frozenset[str] | None = None,
    ) -> None:
        self.package_dir = package_dir
        self.state_dir = package_dir / ".k3patch"
        self.fault = fault or _fault_from_environment
        self.blobs = Blobs(package_dir)
        # The paths a journal may name: the registered targets and k3patch's own record.
        self.allowed = (targets or state.registered_targets()) | {state.STATE_REL}
        self.notes: list[str] = []

    # -- blobs (kept as methods: verify and changes read originals through a Transaction) ----
    def blob_path(self, digest: str) -> Path:
        return self.blobs.path(digest)

    def store_blob(self, data: bytes) -> str:
        return self.blobs.store(data)

    def load_blob(self, digest: str) -> bytes:
        return self.blobs.load(digest)

    def blob_names(self) -> list[str]:
        return self.blobs.names()

    def prune_blobs(self, keep: set[str]) -> None:
        self.blobs.prune(keep)

    # -- commit --------------------------------------------------------------------------
    def commit(self, edits: list[FileEdit], op: str) -> list[str]:
        """Apply all edits or none. Returns the pycache actions taken (and notes)."""
        for edit in edits:
            if edit.rel not in self.allowed:
                raise EnvironmentProblem(f"refusing to write {edit.rel!r}: not a k3patch target")
            if os.path.dirname(edit.rel) != ".k3patch":  # made with the journal, below
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
        journal = state.journal_data(op, entries, os.getpid(), time.time())
        write_atomically(self.package_dir / state.JOURNAL_REL, journal, root=self.package_dir)
        actions: list[str] = []
        written: set[str] = set()
        try:
            self.fault("journal-written")
            for edit in edits:
                for data in (edit.before, edit.after):
                    if data is not None:
                        self.blobs.store(data)
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
        unlink_in(self.package_dir, state.JOURNAL_REL)
        self.fault("journal-removed")
        return actions + self.notes

    def _replace(self, edit: FileEdit, written: set[str]) -> None:
        def about_to_rename() -> None:
            self.fault(f"renaming:{edit.rel}")
            written.add(edit.rel)

        try:
            replace_checked(
                self.package_dir,
                edit.rel,
                edit.before,
                edit.after,
                about_to_rename=about_to_rename,
                notes=self.notes,
            )
        except ConcurrentChange:
            written.discard(edit.rel)  # the other writer's file is in place: not ours to undo
            raise

    def remove_state_dir(self) -> None:
        """The record, an empty blobs/ and `.k3patch` itself; anything else is left where it is.
        Called under the lock."""
        unlink_in(self.package_dir, state.STATE_REL)
        dfd = open_dir_if_there(self.package_dir, ".k3patch")
        if dfd is None:
            return
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
        """The journal of an interrupted commit, checked entry by entry (state.load_journal)."""
        return state.load_journal(self.package_dir, self.allowed)

    def recover(self, only: set[str] | None = None) -> list[str]:
        """Roll an interrupted commit back to its before-images. Returns what was done.
        `only`: the files this process wrote (an in-process rollback leaves the others alone)."""
        journal = self.pending_journal()
        done: list[str] = []
        if journal is not None:
            files = [e for e in journal["files"] if only is None or e["path"] in only]
            for entry in files:
                if self._roll_back(entry):
                    done.append(f"rolled back {entry['path']}")
            for entry in files:
                if entry["path"].endswith(".py"):
                    self._sync_pycache(self.package_dir / entry["path"])
            unlink_in(self.package_dir, state.JOURNAL_REL)
            self._prune_to_record()
        done += self.remove_litter(journal)
        return done

    def _roll_back(self, entry: dict[str, Any]) -> bool:
        """One journalled file back to its before-image; False when it already holds it."""
        rel = entry["path"]
        path = self.package_dir / rel
        dfd = open_dir(self.package_dir, os.path.dirname(rel))
        try:
            current = read_regular(os.path.basename(rel), dir_fd=dfd, shown=path)
        finally:
            os.close(dfd)
        current_hash = None if current is None else sha256(current)
        if current_hash == entry["before"]:
            return False
        if current_hash != entry["after"]:
            raise EnvironmentProblem(
                f"{path} was changed by something else during an interrupted k3patch "
                f"run (now {current_hash and current_hash[:12]}, k3patch wrote "
                f"{entry['after'] and entry['after'][:12]}, before "
                f"{entry['before'] and entry['before'][:12]}); restore it (reinstall "
                f"vLLM) and remove {self.package_dir / state.JOURNAL_REL}"
            )
        if entry["before"] is None:
            unlink_in(self.package_dir, rel)
        else:
            write_atomically(
                path,
                self.blobs.load(entry["before"]),
                like=os.stat(path, follow_symlinks=False) if current is not None else None,
                root=self.package_dir,
            )
        return True

    def _prune_to_record(self) -> None:
        """After a rollback: the saved copies the (rolled back) record needs, and no others."""
        try:
            record = state.load(self.state_dir, self.allowed, self.package_dir)
        except EnvironmentProblem:
            return  # a damaged record keeps every saved copy
        keep = set() if record is None else {fs.original for fs in record.files.values()}
        self.blobs.prune({digest for digest in keep if digest})

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
                dfd = open_dir_if_there(self.package_dir, rel_dir)
            except EnvironmentProblem:
                continue
            if dfd is None:
                continue
            try:
                for entry in os.scandir(dfd):
                    if LITTER.match(entry.name) and entry.is_file(follow_symlinks=False):
                        os.unlink(entry.name, dir_fd=dfd)
                        removed.append(f"removed {self.package_dir / rel_dir / entry.name}")
            finally:
                os.close(dfd)
        return removed


def _fault_from_environment(step: str) -> None:
    """Crash tests set K3PATCH_TEST_CRASH_AT to a step name to make the process die there."""
    target = os.environ.get("K3PATCH_TEST_CRASH_AT")
    if target and (step == target or (target.endswith("*") and step.startswith(target[:-1]))):
        os._exit(137)
