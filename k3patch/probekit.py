"""What a behaviour probe needs in the verify child, written once: stand-ins that are always
undone (environment variables, attributes, whole modules), and a list of checks that becomes a
`ProbeOutcome`.

Runs in the tree's own interpreter, where k3patch is not installed: standard library and
`k3patch.model` only.

    checks = Checks("truth table")
    with Swap() as swap:
        swap.module("vllm.platforms.rocm", fake)
        swap.env("VLLM_ROCM_USE_AITER_MLA", None)      # None: unset
        swap.attr(ops, "_MLA_ENABLED", True)
        checks.expect("unset on gfx942", got=call(), want=False)
    return checks.outcome()
"""

from __future__ import annotations

import os
import sys
import types
from typing import Any

from k3patch.model import ProbeOutcome

_ABSENT = object()


class Swap:
    """A context manager that stands things in and puts every one back on exit, in reverse
    order, also when the probe raises."""

    def __init__(self) -> None:
        self._undo: list[Any] = []

    def __enter__(self) -> Swap:
        return self

    def __exit__(self, *exc: object) -> None:
        while self._undo:
            self._undo.pop()()

    def env(self, name: str, value: str | None) -> None:
        """Set (or with None, unset) an environment variable."""
        old = os.environ.get(name)

        def undo() -> None:
            if old is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = old

        self._undo.append(undo)
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value

    def attr(self, obj: Any, name: str, value: Any) -> None:
        """Set an attribute (a class's own attribute is restored as its own, an inherited or
        absent one is removed again)."""
        own = vars(obj).get(name, _ABSENT) if hasattr(obj, "__dict__") else _ABSENT

        def undo() -> None:
            if own is _ABSENT:
                try:
                    delattr(obj, name)
                except AttributeError:
                    pass
            else:
                setattr(obj, name, own)

        self._undo.append(undo)
        setattr(obj, name, value)

    def module(self, name: str, module: types.ModuleType | None = None) -> types.ModuleType:
        """Put `module` (default: a new empty one) in sys.modules under `name`."""
        module = module if module is not None else types.ModuleType(name)
        old = sys.modules.get(name)

        def undo() -> None:
            if old is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = old

        self._undo.append(undo)
        sys.modules[name] = module
        return module


class Checks:
    """Named checks, each passed or failed, summarised as one ProbeOutcome."""

    def __init__(self, what: str) -> None:
        self.what = what
        self.lines: list[str] = []
        self.failures: list[str] = []
        self.ran = 0

    def note(self, line: str) -> None:
        """A report line that is no check (what was skipped, and why)."""
        self.lines.append(line)

    def check(self, case: str, ok: bool, why: str = "") -> bool:
        self.ran += 1
        self.lines.append(f"{case}: {'ok' if ok else 'FAILED'}{f' ({why})' if why else ''}")
        if not ok:
            self.failures.append(f"{case}{f': {why}' if why else ''}")
        return ok

    def expect(self, case: str, got: Any, want: Any) -> bool:
        ok = got == want
        return self.check(f"{case} -> {got!r}", ok, "" if ok else f"expected {want!r}")

    def outcome(self, holds: str | None = None) -> ProbeOutcome:
        """Failed when a check failed or none ran; `holds` is the summary when all passed
        (default: "<what> holds (N cases)")."""
        if not self.ran:
            return ProbeOutcome(False, f"{self.what}: no check ran", tuple(self.lines))
        if self.failures:
            summary = f"{self.what} broken: " + "; ".join(self.failures)
            return ProbeOutcome(False, summary, tuple(self.lines))
        summary = holds or f"{self.what} holds ({self.ran} cases)"
        return ProbeOutcome(True, summary, tuple(self.lines))
