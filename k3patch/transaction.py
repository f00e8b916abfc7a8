"""The journalled commit: the only code that writes into a vLLM tree.

A commit first removes the bytecode of every source it changes (pycache.py: an unlink needs no
space and no journal), then writes a journal (each file's before and after hash), stores every
before-image as a blob, replaces each file after checking that it still holds its before-image
(replace.py), keeping the old file under a temp name until every file is in place, and removes
the journal. A commit that fails puts the kept files back by renaming them (no space needed, so
a full disk cannot stop the rollback half way). A run that dies in between leaves the journal;
the next run, under the tree's lock, rolls every journalled file (the state record among them)
back to its before-image from the blobs (`recover`) before its own work. Nothing on disk is
trusted: a journal naming anything but a registered target is damaged, never obeyed; and no
file is ever written back with bytes that do not belong to it (`moves_only_sites`): a record's
original on revert and a journal's before-image on recovery (as an apply's plan) must read,
through the patches' own site fingerprints, as that same file with sites moved between pending
and applied and nothing else, so a record or journal whose saved copies were swapped between
files (or that says a file was absent) is refused before anything is written.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from k3patch import state
from k3patch.blobs import BLOBS, Blobs
from k3patch.errors import ConcurrentChange, EnvironmentProblem
from k3patch.pycache import check_cache_dir, remove_bytecode
from k3patch.registry import all_patches
from k3patch.replace import LITTER, put_back, replace_checked, unlink_in, write_atomically
from k3patch.safefs import directories, give_state_to_owner, open_dir, read_in, regular_files
from k3patch.sources import Sources
from k3patch.verdicts import Verdict

FaultHook = Callable[[str], None]


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _hash(data: bytes | None) -> str | None:
    return None if data is None else sha256(data)


@dataclass(frozen=True)
class FileEdit:
    """Replace `rel` (relative to the package dir) holding `before` with `after`.
    None means the file is absent (before) or is to be removed (after)."""

    rel: str
    before: bytes | None
    after: bytes | None


class Transaction:
    """Commits and recovers edits of one tree. Use inside `lock.locked(package_dir)`."""

    def __init__(self, package_dir: Path, fault: FaultHook | None = None) -> None:
        self.package_dir = package_dir
        self.fault = fault or _fault_from_environment
        self.blobs = Blobs(package_dir)
        # Set when the commit reached its end (the journal's removal): an error after that is
        # not a failed commit, and nothing of it may be cleaned up as if it rolled back.
        self.committed = False
        # The paths a journal may name: the registered targets and k3patch's own record.
        self.allowed = state.registered_targets() | {state.STATE_REL}

    # -- commit --------------------------------------------------------------------------
    def commit(self, edits: list[FileEdit], op: str) -> list[str]:
        """Apply all edits or none. Returns the bytecode actions taken (and notes)."""
        # An apply's edits come from engine.plan, which proved the same of these very bytes
        # (classifying them again would double an apply's parse time); a revert's come from
        # saved copies that only the record ties to their files.
        images = [(e.rel, e.before, e.after) for e in edits]
        if op != "apply" and (why := moves_only_sites(self.package_dir, images)):
            raise state.damaged(
                str(self.package_dir / state.STATE_REL),
                f"an original it names does not belong to its file ({why})",
            )
        for edit in edits:
            if edit.rel not in self.allowed:
                raise EnvironmentProblem(f"refusing to write {edit.rel!r}: not a k3patch target")
            # Every directory on the way, before the journal: a symlink above a later target
            # found mid-commit would leave the files before it written and a journal that
            # recovery (it resolves links) must refuse as naming a path outside the tree.
            if os.path.dirname(edit.rel) != ".k3patch":  # made with the journal, below
                os.close(open_dir(self.package_dir, os.path.dirname(edit.rel)))
            if edit.rel.endswith(".py"):
                check_cache_dir(self.package_dir / edit.rel)
        # Bytecode first, before any source changes: nothing to journal, nothing to roll back.
        actions: list[str] = []
        for edit in edits:
            if edit.rel.endswith(".py"):
                actions += remove_bytecode(self.package_dir / edit.rel)
        self.fault("bytecode-removed")
        # Write-ahead: the journal goes first, so that a run killed while storing blobs leaves
        # a journal whose recovery prunes them; saved copies with no journal and no record
        # can then only be originals whose record was lost, and revert keeps them.
        entries = [
            {"path": e.rel, "before": _hash(e.before), "after": _hash(e.after)} for e in edits
        ]
        journal = state.journal_data(op, entries, os.getpid(), time.time())
        write_atomically(self.package_dir / state.JOURNAL_REL, journal, root=self.package_dir)
        notes: list[str] = []
        written: list[FileEdit] = []
        kept: dict[str, str] = {}  # rel -> the temp name its old file is kept under
        try:
            self.fault("journal-written")
            for edit in edits:
                if edit.before is not None:  # what a rollback by the next run puts back
                    self.blobs.store(edit.before)
            self.fault("blobs-written")
            for edit in edits:
                notes += self._replace(edit, written, kept)
                self.fault(f"replaced:{edit.rel}")
            for rel in list(kept):
                # Durable or not, the copy is gone: a failed sync here (a full disk) must not
                # start a rollback that needs space to write that file back.
                unlink_in(self.package_dir, kept.pop(rel), durable=False)
            self.fault("kept-removed")
        except BaseException:
            # Roll back what this run wrote; if that fails too the journal stays for the next run.
            with contextlib.suppress(Exception):
                self._undo(written, kept)
            raise
        self.committed = True
        unlink_in(self.package_dir, state.JOURNAL_REL)
        self.fault("journal-removed")
        return list(dict.fromkeys(actions + notes))  # a warning about a group: once

    def _replace(self, edit: FileEdit, written: list[FileEdit], kept: dict[str, str]) -> list[str]:
        def about_to_rename() -> None:
            self.fault(f"renaming:{edit.rel}")
            written.append(edit)

        keep: list[str] = []
        try:
            return replace_checked(
                self.package_dir, edit.rel, edit.before, edit.after, about_to_rename, keep
            )
        except ConcurrentChange:
            if edit in written:  # the other writer's file is in place: not ours to undo
                written.remove(edit)
            raise
        finally:
            if keep:
                kept[edit.rel] = keep[0]

    def _undo(self, written: list[FileEdit], kept: dict[str, str]) -> None:
        """Put back, last first, each file this run replaced: the kept old file renamed back
        over the new one (no space needed), or where none was kept the saved copy written. Then
        the journal goes, and the blobs no record needs. A file that fails (a directory fsync
        on a full disk) does not stop the others; the journal then stays, for the next run."""
        failed: Exception | None = None
        for edit in reversed(written):
            try:
                current = read_in(self.package_dir, edit.rel)
                if current == edit.before:
                    continue  # the rename never happened
                if edit.rel in kept:
                    put_back(self.package_dir, edit.rel, kept.pop(edit.rel), edit.after)
                else:
                    entry = {"path": edit.rel, "before": _hash(edit.before)}
                    step = self._roll_back_plan({**entry, "after": _hash(edit.after)})
                    if step is not None:
                        replace_checked(self.package_dir, *step)
            except Exception as exc:
                failed = failed or exc
        for keep in kept.values():
            with contextlib.suppress(EnvironmentProblem):
                unlink_in(self.package_dir, keep)
        if failed is not None:
            raise failed
        self._prune_to_record()
        self.remove_litter()  # an old file kept where a look after the exchange failed
        unlink_in(self.package_dir, state.JOURNAL_REL)

    def remove_state_dir(self) -> None:
        """The record, an empty blobs/ and `.k3patch` itself; anything else is left where it is."""
        unlink_in(self.package_dir, state.STATE_REL)
        # Not empty: the rest is not k3patch's, left quietly (unlink_in); any other failure is
        # an error, never a revert that says done and leaves `.k3patch`.
        unlink_in(self.package_dir, f".k3patch/{BLOBS}", rmdir=True)
        unlink_in(self.package_dir, ".k3patch", rmdir=True)

    # -- recovery ------------------------------------------------------------------------
    def pending_journal(self) -> dict[str, Any] | None:
        """The journal of an interrupted commit, checked entry by entry (state.load_journal)."""
        return state.load_journal(self.package_dir, self.allowed)

    def recover(self) -> list[str]:
        """Roll an interrupted commit back to its before-images. Returns what was done. Every
        journalled file is checked (and its saved copy loaded) before the first is put back:
        one that something else changed, or whose copy is gone, stops the recovery with the
        tree as the killed run left it, never with some files of a patch rolled back and
        others not. Once every file is back, their bytecode goes (a pyc compiled from a
        patched file since the kill would otherwise keep it running); a removal that fails
        leaves the journal, so the next run removes it again, with every source already whole."""
        give_state_to_owner(self.package_dir)  # what a root run killed mid-way left root's
        journal = self.pending_journal()
        done: list[str] = []
        if journal is not None:
            plan = [step for e in journal["files"] if (step := self._roll_back_plan(e))]
            where = str(self.package_dir / state.JOURNAL_REL)
            if why := moves_only_sites(self.package_dir, plan):
                raise state.damaged(
                    where, f"a saved copy it names does not belong to its file ({why})"
                )
            if plan and (unnamed := self._unnamed_copies(journal, where)):
                raise state.damaged(
                    where,
                    f"the saved copy {unnamed[0]} is named neither by it nor by the record it "
                    "rolls back to (an entry removed?); rolling back the others would leave "
                    "that file as the killed run wrote it",
                )
            for rel, current, before in plan:
                replace_checked(self.package_dir, rel, current, before)
                done.append(f"rolled back {rel}")
            # The journal goes last: a run that dies before it is done leaves the journal,
            # and the next run finishes the clean-up (saved copies without a record would
            # otherwise stop revert for good).
            self._prune_to_record()
        # With a journal, litter that cannot be removed keeps it (exit 3): once the journal and
        # then `.k3patch` are gone no run looks for it again, and it would stay for good.
        done += self.remove_litter(strict=journal is not None)
        if journal is not None:
            for entry in journal["files"]:
                if entry["path"].endswith(".py"):
                    remove_bytecode(self.package_dir / entry["path"])
            unlink_in(self.package_dir, state.JOURNAL_REL)
        return done

    def _unnamed_copies(self, journal: dict[str, Any], where: str) -> list[str]:
        """The saved copies neither `journal` nor the record it rolls back to names (the record's
        before-image where the journal has one, else the record in place: a revert's commit
        leaves it). A commit writes its journal first, then stores its files' before-images,
        then replaces files: once any file is replaced, every copy there is one of those or an
        original the old record names."""
        entries = journal["files"]
        named = {e["before"] for e in entries if e["before"] is not None}
        journalled = next((e for e in entries if e["path"] == state.STATE_REL), None)
        if journalled is None:
            record = state.load(self.package_dir / ".k3patch", self.allowed, self.package_dir)
        elif journalled["before"] is not None:
            data = self.blobs.load(journalled["before"])
            record = state.parse(data, where, self.package_dir, self.allowed)
        else:
            record = None
        if record is not None:
            named |= record.originals
        return sorted(set(self.blobs.names()) - named)

    def unnamed_original(self, record: state.StateRecord) -> str | None:
        """Why `record` lacks an entry, or None: a saved copy it does not name that reads as the
        original of a target it does not name either (the same sites, moved between pending and
        applied). A kill between a commit and its pruning leaves copies no record names, but
        never one of those: each file a commit saves an original of is in its record."""
        unnamed = sorted(set(self.blobs.names()) - record.originals)
        copies = {digest: self.blobs.load(digest) for digest in unnamed}
        unrecorded = self.allowed - record.files.keys() - {state.STATE_REL}
        for rel in sorted(unrecorded) if copies else []:
            current = read_in(self.package_dir, rel)
            for digest, copy in copies.items():
                if current is not None and is_original_of(self.package_dir, rel, current, copy):
                    return (
                        f"the saved copy {digest[:12]} is an original of vllm/{rel}, a file the "
                        "record does not name (an entry removed?)"
                    )
        return None

    def _roll_back_plan(
        self, entry: dict[str, Any]
    ) -> tuple[str, bytes | None, bytes | None] | None:
        """(path, what it holds now, its before-image) for a journalled file that must be put
        back; raises when it cannot be (changed by something else, or its saved copy is
        missing). A file that already holds its before-image is left out."""
        rel = entry["path"]
        current = read_in(self.package_dir, rel)
        current_hash = _hash(current)
        if current_hash == entry["before"]:
            return None
        if current_hash != entry["after"]:
            raise EnvironmentProblem(
                f"{self.package_dir / rel} was changed by something else during an interrupted "
                f"k3patch run (now {(current_hash or 'absent')[:12]}, k3patch wrote "
                f"{(entry['after'] or 'nothing')[:12]}, before "
                f"{(entry['before'] or 'absent')[:12]}); nothing was rolled back: put "
                f"that file back as k3patch wrote it or as it was before, then run again"
            )
        before = None if entry["before"] is None else self.blobs.load(entry["before"])
        return rel, current, before

    def _prune_to_record(self) -> None:
        """After a rollback: the saved copies the (rolled back) record needs, and no others."""
        try:
            record = state.load(self.package_dir / ".k3patch")
        except EnvironmentProblem:
            return  # a damaged record keeps every saved copy
        self.blobs.prune(record.originals if record else set())

    def remove_litter(self, strict: bool = False) -> list[str]:
        """Temp files left by a killed or failed run (regular files named so) next to the state
        files and beside every registered target, and in its `__pycache__` (where an earlier
        k3patch, killed while it wrote bytecode, left them), journal or not: a run that died
        after its journal was gone must not leave an old file's copy there for good. Runs under
        the lock, so no live run's temp file is there. A directory that cannot be opened, or a
        file that cannot be removed, is left for the next run (`strict`: raises, once the rest
        is removed)."""
        dirs = {".k3patch", f".k3patch/{BLOBS}"}
        for target in self.allowed - {state.STATE_REL}:
            folder = os.path.dirname(target)
            dirs.update((folder, os.path.join(folder, "__pycache__")))
        removed = []
        failed: EnvironmentProblem | None = None
        for rel_dir in sorted(dirs):
            try:
                for name in regular_files(self.package_dir, rel_dir, LITTER):
                    unlink_in(self.package_dir, f"{rel_dir}/{name}")
                    removed.append(f"removed {self.package_dir / rel_dir / name}")
            except EnvironmentProblem as exc:
                failed = failed or exc
        # A state directory a run was killed making, under its temp name (safefs._make_dir).
        for rel_dir in ("", ".k3patch"):
            try:
                for name in directories(self.package_dir, rel_dir, LITTER):
                    unlink_in(self.package_dir, os.path.join(rel_dir, name), rmdir=True)
                    removed.append(f"removed {self.package_dir / rel_dir / name}")
            except EnvironmentProblem as exc:
                failed = failed or exc
        if strict and failed is not None:
            raise failed
        return removed


# The only verdict change a k3patch write may make at a site.
_MOVE = frozenset({Verdict.PENDING, Verdict.APPLIED})


def _site_verdicts(patch: Any, sources: Sources) -> dict[tuple[str, str], Verdict] | str:
    """The patch's sites and their verdicts in `sources`; where the patch cannot judge them
    (it raises on these bytes), the kind of failure, compared as such."""
    try:
        return {(r.site, r.file): r.verdict for r in patch.classify(sources)}
    except Exception as exc:
        return type(exc).__name__


def _verdicts_both_ways(
    package_dir: Path, images: list[tuple[str, bytes | None, bytes | None]]
) -> Iterator[tuple[Any, list[str], Any, Any]]:
    """For each patch reading a target among `images` (path, now, new): the patch, those
    targets, and its site verdicts with every image as it is now and as it would be."""
    targets = state.registered_targets()
    changed = {rel: (now, new) for rel, now, new in images if rel in targets}

    def reader(side: int) -> Any:
        def read(rel: str) -> bytes | None:
            if rel in changed:
                return changed[rel][side]
            try:
                return read_in(package_dir, rel)
            except EnvironmentProblem:
                return None

        return read

    now_sources, new_sources = Sources(reader(0)), Sources(reader(1))
    for patch in all_patches() if changed else ():
        if files := sorted(set(patch.files) & changed.keys()):
            for rel in patch.files:  # read first, as scan does: judged from these bytes alone
                now_sources[rel], new_sources[rel]
            now, new = _site_verdicts(patch, now_sources), _site_verdicts(patch, new_sources)
            yield patch, files, now, new


def is_original_of(package_dir: Path, rel: str, current: bytes, copy: bytes) -> bool:
    """Whether `copy` reads, through every patch's site fingerprints, as the file `current` at
    `rel` with some applied site pending and nothing else changed: an original of it."""
    moved = False
    for _, _, now, new in _verdicts_both_ways(package_dir, [(rel, current, copy)]):
        if isinstance(now, str) or isinstance(new, str) or now.keys() != new.keys():
            return False
        pairs = {(now[key], new[key]) for key in now if now[key] != new[key]}
        if pairs - {(Verdict.APPLIED, Verdict.PENDING)}:
            return False
        moved = moved or bool(pairs)
    return moved


def moves_only_sites(
    package_dir: Path, images: list[tuple[str, bytes | None, bytes | None]]
) -> str | None:
    """Why writing each (path, now, new) of `images` would be more than k3patch's own edit, or
    None. Every patch reading one of these targets must find the same sites in the new bytes as
    in the current ones, each with the same verdict or moved between pending and applied: what
    every apply writes (engine.plan proves it there), so what a revert or rollback writes back.
    Bytes of another file (a record or journal whose saved copies were swapped), or none where a
    vLLM file is (a forged "absent" original), read otherwise. Binds a saved copy to the path
    it is written to by what k3patch knows of that path, its sites, not by the record's word."""
    for patch, files, now, new in _verdicts_both_ways(package_dir, images):
        if isinstance(now, str) or isinstance(new, str) or now.keys() != new.keys():
            if now == new:
                continue
            return f"{patch.id} does not find its sites of {', '.join(files)} in it"
        for (site, rel), verdict in now.items():
            other = new[(site, rel)]
            if verdict != other and {verdict, other} != _MOVE:
                moved = f"{verdict.value} to {other.value}"
                return f"{site} of {patch.id} in vllm/{rel} would go from {moved}"
    return None


def _fault_from_environment(step: str) -> None:
    """Crash tests set K3PATCH_TEST_CRASH_AT to a step name to make the process die there."""
    target = os.environ.get("K3PATCH_TEST_CRASH_AT")
    if target and (step == target or (target.endswith("*") and step.startswith(target[:-1]))):
        os._exit(137)
