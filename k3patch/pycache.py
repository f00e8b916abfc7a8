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
import py_compile
import re
import stat
import sys
from pathlib import Path

from k3patch.errors import EnvironmentProblem
from k3patch.replace import write_atomically
from k3patch.safefs import NotRegular, env_error, open_dir_if_there, read_file

_PYC_NAME = re.compile(r"^(?P<stem>.+?)\.(?P<tag>[^.]+)(?:\.opt-(?P<opt>\d+))?\.pyc$")

_MODE_BY_FLAGS = {
    0: py_compile.PycInvalidationMode.TIMESTAMP,
    1: py_compile.PycInvalidationMode.UNCHECKED_HASH,
    3: py_compile.PycInvalidationMode.CHECKED_HASH,
}


def check_cache_dir(source: Path) -> None:
    """A `__pycache__` that is a symlink or not a directory would have k3patch write pycs
    outside the tree, and a pyc of `source` that is a FIFO, socket, device or link is no
    bytecode k3patch can read or rebuild: both refused before the first write."""
    dfd = open_dir_if_there(source.parent, "__pycache__")  # refuses a link or a non-directory
    if dfd is not None:
        os.close(dfd)
    for pyc in pycs_for(source):
        with contextlib.suppress(FileNotFoundError):
            if not stat.S_ISREG(os.lstat(pyc).st_mode):
                raise EnvironmentProblem(
                    f"{pyc} is not a regular file (a symlink, FIFO, socket or device); k3patch "
                    "reads and rebuilds only real bytecode files. Remove it and run again"
                )


def pycs_for(source: Path) -> list[Path]:
    cache_dir = source.parent / "__pycache__"
    if cache_dir.is_symlink() or not cache_dir.is_dir():
        return []
    found = []
    for entry in cache_dir.iterdir():
        match = _PYC_NAME.match(entry.name)
        if match and match.group("stem") == source.stem and not entry.is_dir():
            found.append(entry)
    return sorted(found)


def _read(path: Path) -> bytes | None:
    """Through the one no-follow, non-blocking reader: None when absent or not a regular file (a
    link or FIFO is never followed, a source that is one never compiled)."""
    try:
        return read_file(path)
    except (OSError, NotRegular):
        return None


def invalidation_mode(pyc: bytes) -> py_compile.PycInvalidationMode | None:
    """The mode a pyc was written in, or None when it is not this interpreter's pyc."""
    if len(pyc) < 8 or pyc[:4] != importlib.util.MAGIC_NUMBER:
        return None
    return _MODE_BY_FLAGS.get(int.from_bytes(pyc[4:8], "little"))


def pyc_bytes(data: bytes, source: Path, mode: py_compile.PycInvalidationMode, opt: int) -> bytes:
    """What `py_compile.compile` writes for `source` holding `data` (PEP 552's header, then the
    code)."""
    code = compile(data, str(source), "exec", dont_inherit=True, optimize=opt)
    if mode is py_compile.PycInvalidationMode.TIMESTAMP:
        flags, st = 0, os.stat(source)
        key = (int(st.st_mtime) & 0xFFFFFFFF).to_bytes(4, "little")
        key += (st.st_size & 0xFFFFFFFF).to_bytes(4, "little")
    else:
        checked = mode is py_compile.PycInvalidationMode.CHECKED_HASH
        flags = 0b01 | (0b10 if checked else 0)
        key = importlib.util.source_hash(data)
    return importlib.util.MAGIC_NUMBER + flags.to_bytes(4, "little") + key + marshal.dumps(code)


def sync_pycache(source: Path) -> list[str]:
    """Recompile or remove every pyc of `source`; returns one line per action, for reports."""
    try:
        return [f"{source.name}: {action}" for action in _sync(source)]
    except OSError as exc:
        raise env_error("update the bytecode of", source, exc) from None


def _sync(source: Path) -> list[str]:
    actions = []
    pycs = pycs_for(source)
    data = _read(source) if pycs else None
    for pyc in pycs:
        match = _PYC_NAME.match(pyc.name)
        assert match is not None
        old = _read(pyc) if match["tag"] == sys.implementation.cache_tag else None
        mode = None if old is None else invalidation_mode(old)
        new = None
        if data is not None and mode is not None:
            # A source that does not compile: its interpreter reads it anew.
            with contextlib.suppress(SyntaxError, ValueError):
                new = pyc_bytes(data, source, mode, int(match["opt"] or 0))
        if new is not None and mode is not None:
            write_atomically(pyc, new, os.lstat(pyc), root=source.parent)
            actions.append(f"recompiled {pyc.name} ({mode.name.lower()})")
        else:
            os.unlink(pyc)  # never opened: a link or FIFO goes without being followed
            actions.append(f"removed {pyc.name}")
    return actions
