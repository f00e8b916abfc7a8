"""Finds the patches: every module in `k3patch.patches` (the repository's `patches/`) that
defines `PATCH`. Adding a patch is adding a module; nothing here names one."""

from __future__ import annotations

import importlib
import os
import pkgutil
from functools import cache
from pathlib import Path

from k3patch import formats
from k3patch.errors import UnknownPatchError
from k3patch.model import Patch


@cache
def all_patches() -> tuple[Patch, ...]:
    package = importlib.import_module("k3patch.patches")
    found: list[Patch] = []
    for info in sorted(pkgutil.iter_modules(package.__path__), key=lambda i: i.name):
        module = importlib.import_module(f"{package.__name__}.{info.name}")
        patch = getattr(module, "PATCH", None)
        if isinstance(patch, Patch):
            found.append(patch)
    return ordered(found)


class PatchOrderError(ValueError):
    """The patches' declared `after` ids name an unknown patch or form a cycle."""


def ordered(patches: list[Patch]) -> tuple[Patch, ...]:
    """The patches in the order their `after` declarations ask for, by id where free."""
    by_id = {p.id: p for p in patches}
    for patch in patches:
        unknown = [dep for dep in patch.after if dep not in by_id]
        if unknown:
            raise PatchOrderError(f"{patch.id}: after names unknown patch(es) {unknown}")
    done: list[Patch] = []
    placed: set[str] = set()
    waiting = sorted(by_id)
    while waiting:
        ready = [pid for pid in waiting if set(by_id[pid].after) <= placed]
        if not ready:
            raise PatchOrderError(f"the after declarations of {waiting} form a cycle")
        first = ready[0]
        done.append(by_id[first])
        placed.add(first)
        waiting.remove(first)
    return tuple(done)


def select(only: list[str] | None = None, skip: list[str] | None = None) -> tuple[Patch, ...]:
    """The patches named by `--only`/`--skip`; an unknown id is a usage error."""
    patches = all_patches()
    known = {p.id for p in patches}
    for patch_id in [*(only or []), *(skip or [])]:
        if patch_id not in known:
            raise UnknownPatchError(
                f"unknown patch {patch_id!r}; known: {', '.join(sorted(known))}"
            )
    chosen = [p for p in patches if not only or p.id in only]
    return tuple(p for p in chosen if not skip or p.id not in skip)


def patches_dir() -> Path:
    """The directory the patches are loaded from (the repository's `patches/`, installed as
    `k3patch/patches/`)."""
    package = importlib.import_module("k3patch.patches")
    return Path(os.path.dirname(package.__file__ or ""))


def patch_module_file(patch: Patch) -> Path:
    import sys

    return Path(sys.modules[type(patch).__module__].__file__ or "")


@cache
def patch_set_digest() -> str:
    """A hash of the patch modules' own source: a state record made by other patch code is stale."""
    package = importlib.import_module("k3patch.patches")
    return formats.patch_set_digest(os.path.dirname(package.__file__ or ""))
