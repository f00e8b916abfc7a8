"""Finds the patches: every folder of `k3patch.patches` that defines `PATCH`. Each folder's
`files.txt` must list exactly its patch's `files`: the no-op path hashes their union
(`k3patch.patches.TARGETS`) without importing a patch, so a file missing there would go
unchecked, and the registry refuses to run."""

from __future__ import annotations

import graphlib
import importlib
import pkgutil
from collections.abc import Iterable, Mapping
from functools import cache
from pathlib import Path

from k3patch import state
from k3patch.errors import PatchBug, UnknownPatchError
from k3patch.patch import Patch


class PatchOrderError(ValueError):
    """The patches' declared `after` ids name an unknown patch or form a cycle."""


class PatchSetError(PatchBug):
    """A patch's `files` and its folder's `files.txt` differ (a bug of the patch set)."""


@cache
def all_patches() -> tuple[Patch, ...]:
    package = importlib.import_module("k3patch.patches")
    names = sorted(info.name for info in pkgutil.iter_modules(package.__path__))
    modules = {name: importlib.import_module(f"{package.__name__}.{name}") for name in names}
    found = {n: m.PATCH for n, m in modules.items() if isinstance(getattr(m, "PATCH", None), Patch)}
    check_declared(found, package.DECLARED)
    check_targets(found.values(), state.registered_targets())
    return ordered(list(found.values()))


def check_declared(found: Mapping[str, Patch], declared: Mapping[str, tuple[str, ...]]) -> None:
    """Each patch is a folder whose files.txt lists exactly its `files`; a files.txt without a
    patch is an error too (the no-op path would hash files no patch reads)."""
    problems = []
    for name in sorted({*found, *declared}):
        files, listed = set(found[name].files) if name in found else set(), declared.get(name)
        if listed is None:
            problems.append(f"{name} is a module: a patch is a folder with a files.txt")
            continue
        if files and not listed:
            problems.append(f"patches/{name}/files.txt is missing or empty: list {sorted(files)}")
            continue
        what = [f"add {', '.join(sorted(files - set(listed)))}"] if files - set(listed) else []
        if set(listed) - files:
            what.append(f"remove {', '.join(sorted(set(listed) - files))} (its patch reads none)")
        if what:
            problems.append(f"patches/{name}/files.txt: " + "; ".join(what))
    if problems:
        raise PatchSetError(
            "the patch set is inconsistent (each folder's files.txt lists its PATCH.files, which "
            "the no-op path hashes without importing the patch): " + "; ".join(problems)
        )


def check_targets(patches: Iterable[Patch], targets: frozenset[str]) -> None:
    """The union of every patch's `files` must be TARGETS, exactly."""
    files = {rel for patch in patches for rel in patch.files}
    missing, extra = sorted(files - targets), sorted(targets - files)
    if missing or extra:
        what = [f"add {', '.join(missing)} to it"] if missing else []
        what += [f"remove {', '.join(extra)} from it (no patch reads them)"] if extra else []
        raise PatchSetError(
            "the patches' files and TARGETS (the union of the files.txt lists) differ: "
            + "; ".join(what)
        )


def ordered(patches: list[Patch]) -> tuple[Patch, ...]:
    """The patches in the order their `after` declarations ask for, by id where free."""
    by_id = {p.id: p for p in patches}
    for patch in patches:
        unknown = [dep for dep in patch.after if dep not in by_id]
        if unknown:
            raise PatchOrderError(f"{patch.id}: after names unknown patch(es) {unknown}")
    sorter = graphlib.TopologicalSorter({p.id: p.after for p in patches})
    try:
        sorter.prepare()
    except graphlib.CycleError as exc:
        raise PatchOrderError(
            f"the after declarations of {sorted(set(exc.args[1]))} form a cycle"
        ) from None
    done: list[Patch] = []
    ready: list[str] = []
    while sorter.is_active():
        ready = sorted([*ready, *sorter.get_ready()])
        first = ready.pop(0)  # one at a time, so that the smallest id free to go goes first
        done.append(by_id[first])
        sorter.done(first)
    return tuple(done)


def select(only: list[str] | None = None, skip: list[str] | None = None) -> tuple[Patch, ...]:
    """The patches named by `--only`/`--skip`; an unknown id, or one in both, is a usage error."""
    patches = all_patches()
    known = {p.id for p in patches}
    for patch_id in [*(only or []), *(skip or [])]:
        if patch_id not in known:
            raise UnknownPatchError(
                f"unknown patch {patch_id!r}; known: {', '.join(sorted(known))}"
            )
    if both := sorted(set(only or ()) & set(skip or ())):
        raise UnknownPatchError(f"--only and --skip both name {both[0]!r}; give it to one of them")
    return tuple(p for p in patches if (not only or p.id in only) and p.id not in (skip or []))


def patches_dir() -> Path:
    """The directory the patches are loaded from (`patches/`, installed as `k3patch/patches/`)."""
    return Path(importlib.import_module("k3patch.patches").__file__ or "").parent
