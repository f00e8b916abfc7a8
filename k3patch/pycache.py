"""Brings `__pycache__` in line with an edited source file.

Images built with `compileall --invalidation-mode unchecked-hash` keep running the old code after
the source changes (pip's timestamp pycs notice it). Each pyc of an edited file is recompiled in
the mode it had when it is this interpreter's, and removed otherwise (another cache tag or magic
number), so that interpreter reads the new source. Both go through safefs and replace.py, never
`py_compile`, which opens the source blocking and writes the pyc through a link.
"""

from __future__ import annotations

import contextlib
import importlib.util
import marshal
import os
import re
import struct
import sys
from pathlib import Path

from k3patch.errors import EnvironmentProblem
from k3patch.replace import write_atomically
from k3patch.safefs import env_error, open_dir_if_there, read_in

_PYC_NAME = re.compile(r"^(?P<stem>.+?)\.(?P<tag>[^.]+)(?:\.opt-(?P<opt>\d+))?\.pyc$")

# PEP 552's flags word, as `py_compile.PycInvalidationMode` names the modes.
_MODES = {0: "timestamp", 1: "unchecked_hash", 3: "checked_hash"}


def _pycs(source: Path) -> dict[str, bool]:
    """Each pyc of `source` in its `__pycache__` (a link or non-directory there is refused):
    its name -> whether it is a regular file."""
    dfd = open_dir_if_there(source.parent, "__pycache__")
    if dfd is None:
        return {}
    try:
        return {
            entry.name: entry.is_file(follow_symlinks=False)
            for entry in sorted(os.scandir(dfd), key=lambda e: e.name)
            if (match := _PYC_NAME.match(entry.name))
            and match["stem"] == source.stem
            and not entry.is_dir()
        }
    finally:
        os.close(dfd)


def check_cache_dir(source: Path) -> None:
    """A `__pycache__` that is a symlink or not a directory would have k3patch write pycs
    outside the tree, and a pyc of `source` that is a FIFO, socket, device or link is no
    bytecode k3patch can read or rebuild: both refused before the first write."""
    for name, regular in _pycs(source).items():
        if not regular:
            raise EnvironmentProblem(
                f"{source.parent / '__pycache__' / name} is not a regular file (a symlink, FIFO, "
                "socket or device); k3patch reads and rebuilds only real bytecode files. Remove "
                "it and run again"
            )


def pyc_bytes(data: bytes, source: Path, flags: int, opt: int) -> bytes:
    """What `py_compile.compile` writes for `source` holding `data` in the mode `flags` (PEP
    552's header, then the code)."""
    code = compile(data, str(source), "exec", dont_inherit=True, optimize=opt)
    if flags == 0:
        st = os.stat(source)
        key = struct.pack("<II", int(st.st_mtime) & 0xFFFFFFFF, st.st_size & 0xFFFFFFFF)
    else:
        key = importlib.util.source_hash(data)
    return importlib.util.MAGIC_NUMBER + flags.to_bytes(4, "little") + key + marshal.dumps(code)


def _readable(root: Path, rel: str) -> bytes | None:
    """None when the file cannot be read (another user's 0600 pyc, say): its pycs are then
    removed, which needs only the directory, and the interpreter compiles the source anew."""
    try:
        return read_in(root, rel)
    except EnvironmentProblem:
        return None


def sync_pycache(source: Path) -> list[str]:
    """Recompile or remove every pyc of `source`; returns one line per action, for reports."""
    cache = source.parent / "__pycache__"
    actions = []
    pycs = _pycs(source)
    data = _readable(source.parent, source.name) if pycs else None
    try:
        for name, regular in pycs.items():
            match = _PYC_NAME.match(name)
            assert match is not None
            old = None
            if regular and match["tag"] == sys.implementation.cache_tag:
                old = _readable(source.parent, f"__pycache__/{name}")
            flags = -1
            if old is not None and len(old) >= 8 and old[:4] == importlib.util.MAGIC_NUMBER:
                flags = int.from_bytes(old[4:8], "little")
            new = None
            if data is not None and flags in _MODES:
                # A source that does not compile: its interpreter reads it anew.
                with contextlib.suppress(SyntaxError, ValueError):
                    new = pyc_bytes(data, source, flags, int(match["opt"] or 0))
            if new is not None:
                write_atomically(cache / name, new, root=source.parent)
                actions.append(f"{source.name}: recompiled {name} ({_MODES[flags]})")
            else:
                os.unlink(cache / name)  # a link or FIFO goes unopened, never followed
                actions.append(f"{source.name}: removed {name}")
    except OSError as exc:
        raise env_error("update the bytecode of", source, exc) from None
    return actions
