"""Finds the patches: every module or folder in `k3patch.patches` that defines `PATCH`, and
checks them against `k3patch.patches.TARGETS`, the files the no-op path hashes without importing
a patch (a file missing there would go unchecked, so the registry refuses to run)."""

from __future__ import annotations

import graphlib
import importlib
import pkgutil
from collections.abc import Iterable
from functools import cache
from pathlib import Path

from k3patch import state
from k3patch.errors import PatchBug, UnknownPatchError
from k3patch.patch import Patch


class PatchOrderError(ValueError):
    """The patches' declared `after` ids name an unknown patch or form a cycle."""


class PatchSetError(PatchBug):
    """The patches' `files` and `k3patch.patches.TARGETS` differ (a bug of the patch set)."""


@cache
def all_patches() -> tuple[Patch, ...]:
    package = importlib.import_module("k3patch.patches")
    names = sorted(info.name for info in pkgutil.iter_modules(package.__path__))
    modules = [importlib.import_module(f"{package.__name__}.{name}") for name in names]
    found: list[Patch] = [m.PATCH for m in modules if isinstance(getattr(m, "PATCH", None), Patch)]
    check_targets(found, state.registered_targets())
    return ordered(found)


def check_targets(patches: Iterable[Patch], targets: frozenset[str]) -> None:
    """The union of every patch's `files` must be the TARGETS table, exactly."""
    files = {rel for patch in patches for rel in patch.files}
    missing, extra = sorted(files - targets), sorted(targets - files)
    if missing or extra:
        what = [f"add {', '.join(missing)} to it"] if missing else []
        what += [f"remove {', '.join(extra)} from it (no patch reads them)"] if extra else []
        raise PatchSetError(
            "the patches' files and TARGETS in patches/__init__.py differ (the no-op path hashes "
            "TARGETS): " + "; ".join(what)
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
