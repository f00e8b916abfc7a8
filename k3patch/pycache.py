"""Bytecode of a file k3patch changes is removed before the source changes.

Images built with `compileall --invalidation-mode unchecked-hash` keep running the old code after
the source changes (a timestamp pyc notices the change, an unchecked-hash one never does). So
every pyc of a file about to change is unlinked first, wherever an interpreter looks for it:
`__pycache__` beside the source (every cache tag and optimization level) and this interpreter's
`sys.pycache_prefix` (`PYTHONPYCACHEPREFIX`), where Python then looks instead. An unlink needs no
space and no journal (a missing pyc is only a recompile), so bytecode can never make a commit or
its rollback fail half way; the interpreter compiles the new source and writes a timestamp pyc
where it may (a read-only tree just runs from source). A pyc this user may not remove (root ran
`import vllm` once) is left when its interpreter sees it is stale by itself (timestamp,
checked-hash); an unchecked-hash one is refused before anything is removed or written.
`stale_bytecode` is status's side: an unchecked-hash pyc this interpreter would load that does not
hold the code of the file beside it. `imported_instead` is the other way import skips the source:
a compiled extension module named like it, or a sourceless `.pyc` where the `.py` is gone.
"""

from __future__ import annotations

import errno
import importlib.machinery
import importlib.util
import os
import re
import sys
from pathlib import Path

from k3patch.errors import EnvironmentProblem
from k3patch.safefs import DIR_FLAGS, NotRegular, env_error, open_dir_if_there, open_regular

_PYC_NAME = re.compile(r"^(?P<stem>.+?)\.(?P<tag>[^.]+)(?:\.opt-(?P<opt>\d+))?\.pyc$")

# PEP 552's flags word, as `py_compile.PycInvalidationMode` names the modes.
_MODES = {0: "timestamp", 1: "unchecked-hash", 3: "checked-hash"}
_UNCHECKED = 1
_MAY_NOT = (errno.EACCES, errno.EPERM, errno.EROFS)


def _prefix_dir(source: Path) -> Path | None:
    """Where this interpreter keeps `source`'s bytecode under `sys.pycache_prefix`, if set."""
    if not sys.pycache_prefix:
        return None
    return Path(importlib.util.cache_from_source(os.path.abspath(source))).parent


def _open_places(source: Path) -> list[tuple[Path, int]]:
    """(directory, fd) of every place `source` may have bytecode. The `__pycache__` in the tree
    is opened without following a link (a link or non-directory there is refused); the prefix is
    the environment's own choice, outside the tree."""
    places = []
    fd = open_dir_if_there(source.parent, "__pycache__")
    if fd is not None:
        places.append((source.parent / "__pycache__", fd))
    prefix = _prefix_dir(source)
    if prefix is not None:
        try:
            places.append((prefix, os.open(prefix, DIR_FLAGS)))
        except FileNotFoundError:
            pass
        except OSError as exc:
            for _, opened in places:
                os.close(opened)
            raise env_error("open the bytecode directory", prefix, exc) from None
    return places


def _pycs(dfd: int, stem: str) -> list[str]:
    """The name of each pyc of the source named `stem` in the directory `dfd` (anything but a
    directory so named)."""
    return [
        entry.name
        for entry in sorted(os.scandir(dfd), key=lambda e: e.name)
        if (match := _PYC_NAME.match(entry.name))
        and match["stem"] == stem
        and not entry.is_dir(follow_symlinks=False)
    ]


def _header(path: str, dir_fd: int | None = None) -> bytes:
    """The first 16 bytes (PEP 552's header) of the regular file at `path`; b"" when it is
    absent, not a regular file or cannot be read (no interpreter of this user loads it then)."""
    try:
        fd = open_regular(path, dir_fd=dir_fd)
    except (NotRegular, OSError):
        return b""
    if fd is None:
        return b""
    try:
        return os.pread(fd, 16, 0)
    except OSError:
        return b""
    finally:
        os.close(fd)


def _flags(head: bytes) -> int | None:
    """The PEP 552 flags of a pyc (any interpreter's since 3.7), None when there is no header."""
    return int.from_bytes(head[4:8], "little") if len(head) >= 16 else None


def check_cache_dir(source: Path) -> None:
    """Before the first write: a `__pycache__` that is a symlink or not a directory would have
    k3patch remove files outside the tree, and an unchecked-hash pyc this user may not remove
    would keep the old code running; both refused. (A FIFO, socket, device or link named like a
    pyc is removed like any pyc, never opened.)"""
    for where, dfd in _open_places(source):
        try:
            if os.access(where, os.W_OK | os.X_OK):
                continue
            for name in _pycs(dfd, source.stem):
                if _flags(_header(name, dfd)) == _UNCHECKED:
                    raise EnvironmentProblem(
                        f"cannot remove {where / name}: permission denied, and it is "
                        "unchecked-hash bytecode that Python would run instead of the changed "
                        "source. Remove it as its owner (or run as the owner of its directory) "
                        "and run again; nothing was written"
                    )
        finally:
            os.close(dfd)


def remove_bytecode(source: Path) -> list[str]:
    """Remove every pyc of `source` (see the module); one line per action, for reports."""
    actions = []
    for where, dfd in _open_places(source):
        try:
            for name in _pycs(dfd, source.stem):
                # Beside the source its name says where it was; under the prefix, the path.
                shown = name if where.parent == source.parent else str(where / name)
                try:
                    os.unlink(name, dir_fd=dfd)  # a link or FIFO goes unopened, never followed
                    actions.append(f"{source.name}: removed {shown}")
                except FileNotFoundError:
                    pass
                except OSError as exc:
                    flags = _flags(_header(name, dfd))
                    if exc.errno not in _MAY_NOT or flags == _UNCHECKED:
                        raise env_error("remove the bytecode", where / name, exc) from None
                    why = (
                        "nor read it, so its Python cannot load it"
                        if flags is None
                        else f"{_MODES.get(flags, 'other')} bytecode, which Python checks "
                        "against the source"
                    )
                    actions.append(
                        f"{source.name}: left {shown} (this user may not remove it; {why})"
                    )
            os.fsync(dfd)
        except OSError as exc:
            raise env_error("remove the bytecode of", source, exc) from None
        finally:
            os.close(dfd)
    return actions


def stale_bytecode(source: Path, data: bytes | None) -> str | None:
    """The path of an unchecked-hash pyc this interpreter would load for `source` (holding
    `data`; None: absent) that was compiled from other bytes, or None. Python never checks such a
    pyc against its source: it runs the code in it, whatever the file says."""
    if data is None:
        return None
    want = None
    # cache_from_source once (it is most of this check's cost): the -O and -OO names add a tag.
    plain = importlib.util.cache_from_source(os.path.abspath(source))
    for path in (plain, plain[:-4] + ".opt-1.pyc", plain[:-4] + ".opt-2.pyc"):
        head = _header(path)
        if head[:4] != importlib.util.MAGIC_NUMBER or _flags(head) != _UNCHECKED:
            continue
        want = want or importlib.util.source_hash(data)
        if head[8:16] != want:
            return path
    return None


def imported_instead(source: Path) -> str | None:
    """The file import loads for the module of `source` instead of `source`, or None. Python's
    path finder picks the loader by the file's name alone, before it opens anything: an extension
    module (any of `EXTENSION_SUFFIXES`: `_aiter_ops.cpython-311-x86_64-linux-gnu.so`,
    `.abi3.so`, `.so`) beside the source wins over it, and where the `.py` is absent a sourceless
    `_aiter_ops.pyc` (`compileall -b`) is imported. Neither is code k3patch can read or change.
    One stat per suffix; a regular file (links followed, as import does) counts."""
    stem = os.path.join(source.parent, source.stem)
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        if os.path.isfile(stem + suffix):
            return stem + suffix
    if not os.path.lexists(source):
        for suffix in importlib.machinery.BYTECODE_SUFFIXES:
            if os.path.isfile(stem + suffix):
                return stem + suffix
    return None


def instead_why(rel: str, path: str) -> str:
    """One line for a target whose import loads `path` (from `imported_instead`) instead."""
    name = os.path.basename(path)
    if path.endswith(tuple(importlib.machinery.BYTECODE_SUFFIXES)):
        return (
            f"{rel}: present only as bytecode ({name}, which Python imports); k3patch needs the "
            "source: reinstall vLLM with its .py files"
        )
    return (
        f"{rel}: Python imports the compiled extension {name} beside it, not the .py; k3patch "
        "changes source only: remove the extension module (or use a source build of vLLM)"
    )
