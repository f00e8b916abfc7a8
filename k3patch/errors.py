"""Every error k3patch raises on purpose, here so that the modules raising them and exitcodes.py
(which maps them to exit codes) need not import each other."""

from __future__ import annotations


class EnvironmentProblem(Exception):
    """The tree cannot be written here: read-only, permission denied, disk full, lock timeout.
    Nothing is left changed when this is raised."""


class BadLockTimeout(ValueError):
    """--lock-timeout must be a finite number of seconds, zero or more (a usage error)."""


class ConcurrentChange(Exception):
    """A file changed under us (not by k3patch); the commit was rolled back."""


class TreeError(Exception):
    """The tree cannot be used. `usage` is True when the user pointed at the wrong thing."""

    def __init__(self, message: str, *, usage: bool) -> None:
        super().__init__(message)
        self.usage = usage


class UnknownPatchError(ValueError):
    """`--only`/`--skip` named a patch this k3patch does not carry (a usage error)."""


class PatchBug(Exception):
    """A patch produced code that does not compile or does not classify as applied.
    This is k3patch's fault, never the tree's: nothing was written."""


class VerifyError(Exception):
    """The verify child could not run at all (bad --python, crash before reporting)."""
