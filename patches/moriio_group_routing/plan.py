"""The transfer plan site (MoRIIOWriter._prepare_transfer_plan): the per-layer choice of block
ids and the offsets cache, and the older fix's first-chunk defect in build_connector_meta."""

from __future__ import annotations

import ast
from dataclasses import dataclass

from k3patch.edits import Edit, SourceText, replace
from k3patch.model import SourceFile, stored_names
from k3patch.shapes import match, parse_pattern, search

from . import forms
from .forms import indented
from .sites import Look, Part, State, drift, function, short


@dataclass(frozen=True)
class Region:
    kind: str  # "fork", "legacy" or "k3patch"
    stmts: list[ast.stmt]  # the statements `apply` replaces
    debug: bool  # the fork's K3_MAMBA_BC block sits between the choice and the offsets call


def _stores(node: ast.AST) -> set[str]:
    """Names bound anywhere under `node`: assignment and loop targets, and imports."""
    imports = [n for n in ast.walk(node) if isinstance(n, ast.Import | ast.ImportFrom)]
    return stored_names([node]) | {
        (a.asname or a.name).split(".")[0] for n in imports for a in n.names
    }


def is_debug_block(imp: ast.stmt, gate: ast.stmt) -> bool:
    """`import os as X` + `if X.environ.get('K3_MAMBA_BC', '0') == '1': ...` that only logs:
    no else branch, and nothing bound that the offsets call or the cache store reads."""
    if not (
        isinstance(imp, ast.Import)
        and len(imp.names) == 1
        and imp.names[0].name == "os"
        and imp.names[0].asname
        and isinstance(gate, ast.If)
        and not gate.orelse
    ):
        return False
    test = forms.DEBUG_TEST.format(alias=imp.names[0].asname)
    read_later = {"offsets", "geometry_key", "_k3_local", "_k3_remote", "task", "request_info"}
    return match(test, gate.test) is not None and not _stores(gate) & read_later


def regions(fn: ast.FunctionDef) -> list[Region]:
    found = [
        Region("k3patch", block[i : i + len(parse_pattern(forms.K3PATCH_PLAN))], False)
        for block, i, _ in search(forms.K3PATCH_PLAN, fn)
    ]
    for (kind, debug), pattern in forms.PLANS.items():
        for block, i, holes in search(pattern, fn):
            if not debug or is_debug_block(holes["HOLE_debug_import"], holes["HOLE_debug_gate"]):
                found.append(Region(kind, block[i : i + 3], debug))
    return found


@dataclass(frozen=True)
class Plan(Part):
    """The per-layer choice of block ids and the offsets cache in the transfer plan."""

    scope: str
    evidence = True

    def look(self, src: SourceFile) -> Look:
        fn = function(src, self.scope)
        if fn is None:
            return drift(f"{self.scope} is absent", expected=(self.scope,))
        found = regions(fn)
        if len(found) != 1:
            return drift(
                f"{self.scope}: the per-layer block-id choice is in no known shape"
                + (f" ({len(found)} candidate regions)" if found else ""),
                short(src.segment(fn), 60),
                (
                    f"fork: {forms.dedent(forms.PLAN_HEAD)}if {forms.PLAN_MISS}:\n"
                    f"{indented(forms.FORK_CHOICE)}    [K3_MAMBA_BC debug block]\n"
                    f"{indented(forms.PLAN_TAIL)}",
                    f"older k3-group-routing fix: the same with\n{indented(forms.LEGACY_CHOICE)}",
                    f"k3patch: {forms.dedent(forms.K3PATCH_PLAN)}",
                ),
                fn.lineno,
            )
        region = found[0]
        line = region.stmts[0].lineno
        if region.kind == "k3patch":
            return Look(State.APPLIED, line)
        goes = f"; {forms.DEBUG_GOES}" if region.debug else ""
        if region.kind == "fork":
            return Look(State.FORK, line, why=forms.FORK_DEFECT + goes)
        why = f"the older k3-group-routing fix: {forms.GEOMETRY_DEFECT}; {forms.LEGACY_CAVEATS}"
        if region.debug:
            why += f"; {forms.LEGACY_DEBUG_DEFECT}"
        return Look(State.FORK, line, why=why + goes, shape=forms.LEGACY_SHAPE)

    def edits(self, src: SourceFile, text: SourceText) -> list[Edit]:
        fn = function(src, self.scope)
        assert fn is not None
        return [replace(text, regions(fn)[0].stmts, forms.K3PATCH_PLAN)]


@dataclass(frozen=True)
class LegacyGrowth(Part):
    """No opinion on the site's state; names the older fix's first-chunk defect where its
    capture (in `capture_in`) is there and its chunked companion (in `grow_in`) is not."""

    capture_in: str
    grow_in: str

    def look(self, src: SourceFile) -> Look:
        capture, grow = function(src, self.capture_in), function(src, self.grow_in)
        if capture is None or grow is None or not search(forms.LEGACY_CAPTURE, capture):
            return Look(None)
        if search(forms.CHUNKED_ALLGRP, grow):
            why = "the older fix's chunked companion grows its all-group lists per chunk"
            return Look(None, why=why, shape=forms.LEGACY_CHUNKED_SHAPE)
        why = f"older k3-group-routing fix: {forms.FIRST_CHUNK_DEFECT}"
        return Look(None, why=why, shape=forms.LEGACY_SHAPE)
