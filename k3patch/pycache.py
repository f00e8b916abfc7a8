"""Brings `__pycache__` in line with an edited source file.

pip writes timestamp pycs, which notice an edit; but images built with
`compileall --invalidation-mode unchecked-hash` keep running the old code after the source
changes. Each pyc of an edited file is recompiled in the invalidation mode it had, when it
belongs to this interpreter; a pyc of another interpreter (another cache tag or magic number)
cannot be rebuilt here and is removed, so that interpreter reads the new source.

The source is read, and the pyc written, through safefs and replace.py (never `py_compile`,
which opens the source blocking and writes the pyc through a link): a FIFO there is never opened.
"""

from __future__ import annotations

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
from k3patch.safefs import NotRegular, open_regular, read_fd

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
    cache_dir = source.parent / "__pycache__"
    if os.path.islink(cache_dir) or (os.path.lexists(cache_dir) and not cache_dir.is_dir()):
        raise EnvironmentProblem(
            f"{cache_dir} is a symlink or not a directory; k3patch writes bytecode only into a "
            "real __pycache__ inside the tree. Remove it and run again"
        )
    for pyc in pycs_for(source):
        try:
            mode = os.lstat(pyc).st_mode
        except FileNotFoundError:
            continue
        if not stat.S_ISREG(mode):
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


def invalidation_mode(pyc: Path) -> py_compile.PycInvalidationMode | None:
    """The mode a pyc was written in, or None when it is not this interpreter's pyc (or not a
    regular file: read through safefs, a link or FIFO in `__pycache__` is never followed)."""
    try:
        fd = open_regular(pyc)
    except (OSError, NotRegular):
        return None
    if fd is None:
        return None
    try:
        header = os.read(fd, 8)
    except OSError:
        return None
    finally:
        os.close(fd)
    if len(header) < 8 or header[:4] != importlib.util.MAGIC_NUMBER:
        return None
    return _MODE_BY_FLAGS.get(int.from_bytes(header[4:8], "little"))


def _read_source(source: Path) -> tuple[bytes, os.stat_result] | None:
    """The source's bytes and stat through the one no-follow, non-blocking reader; None when it
    is absent or not a regular file (its pycs are then removed, never rebuilt from it)."""
    try:
        fd = open_regular(source)
    except (OSError, NotRegular):
        return None
    if fd is None:
        return None
    try:
        return read_fd(fd), os.fstat(fd)
    finally:
        os.close(fd)


def pyc_bytes(
    data: bytes,
    st: os.stat_result,
    dfile: str,
    mode: py_compile.PycInvalidationMode,
    optimize: int,
) -> bytes:
    """What `py_compile.compile` writes for this source (PEP 552's header, then the code)."""
    code = compile(data, dfile, "exec", dont_inherit=True, optimize=optimize)
    if mode is py_compile.PycInvalidationMode.TIMESTAMP:
        flags = 0
        key = (int(st.st_mtime) & 0xFFFFFFFF).to_bytes(4, "little")
        key += (st.st_size & 0xFFFFFFFF).to_bytes(4, "little")
    else:
        checked = mode is py_compile.PycInvalidationMode.CHECKED_HASH
        flags = 0b01 | (0b10 if checked else 0)
        key = importlib.util.source_hash(data)
    return importlib.util.MAGIC_NUMBER + flags.to_bytes(4, "little") + key + marshal.dumps(code)


def sync_pycache(source: Path) -> list[str]:
    """Recompile or remove every pyc of `source`; returns one line per action, for reports."""
    actions = []
    for pyc in pycs_for(source):
        match = _PYC_NAME.match(pyc.name)
        assert match is not None
        mode = invalidation_mode(pyc)
        ours = match.group("tag") == sys.implementation.cache_tag and mode is not None
        read = _read_source(source) if ours else None
        new = None
        if read is not None and mode is not None:
            optimize = int(match.group("opt") or 0)
            try:
                new = pyc_bytes(read[0], read[1], str(source), mode, optimize)
            except (SyntaxError, ValueError):
                new = None  # a source that does not compile: its interpreter reads it anew
        if new is not None and mode is not None:
            write_atomically(pyc, new, os.lstat(pyc), root=source.parent)
            actions.append(f"recompiled {pyc.name} ({mode.name.lower()})")
        else:
            os.unlink(pyc)  # never opened: a link or FIFO goes without being followed
            actions.append(f"removed {pyc.name}")
    return actions
