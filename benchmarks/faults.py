"""Fault injection over every filesystem call of `apply`, `revert` and the recovery of an
interrupted run (issue 26, item 1), the way SQLite tests I/O errors: record every call a command
makes on a real tree, then run it again once per recorded call with that call failing, and check
the tree each time. Run by hand (the whole campaign; `tests/test_faults.py` runs a sample):

    .venv/bin/python benchmarks/faults.py                  # every row, writes RELIABILITY.md
    .venv/bin/python benchmarks/faults.py --trees 0.31.0 --commands apply --kinds EIO --call 57 -v
                                                           # one run, explained (a repro)

How. The calls are caught at the Python level, in a child process forked from this one (a fork
server: k3patch, libcst and every patch imported once, then one fork per run): every `os`
function that touches the filesystem, `open`/`io.open` and the file objects they return (read,
write, flush, close), `fcntl.flock`, and libc functions fetched through ctypes (k3patch's
`renameat2` exchange). A call counts when its path, its `dir_fd`'s directory or its descriptor's
file lies under the tree. Why not strace's syscall injection: strace counts a syscall's calls
across the whole process (an interpreter start is thousands of them) and filters paths only by
exact name, so "the 57th call on the tree" cannot be said to it; at the Python level every call
k3patch makes is visible with its path and its k3patch call site (file, line, function), which
is what makes a failure readable. What this level cannot see: syscalls made inside C code for
one Python call (a FileIO's fstat on open, getdents while a scandir iterates) are one call here,
failed as one; and calls k3patch does not make through these names (none today; a new call
would show as a smaller call count, not as a silent pass of the calls that exist).

Fault kinds, each run failing one call N (N runs over every recorded call):
- ENOSPC, EIO, EACCES/EPERM: call N raises (EPERM for chown, chmod and xattr calls, EACCES
  otherwise) and has no effect (`close` still closes: Linux releases the descriptor).
- disk full: ENOSPC at call N and at every later call that needs space (creating a file or a
  directory, write, fsync, setxattr): a disk that filled up there and stays full while the
  run rolls back. N runs over the calls that need space.
- kill: SIGKILL right before call N.

After each run: (1) half-patched: every target file is byte-for-byte its original or its
patched bytes, all of them one or the other (apply is one transaction; a journal left by a
killed run excuses a mix until the next run, nothing else does), and no pyc the interpreter
would load holds other code than its source (an unchecked-hash pyc of the old code, a corrupt
pyc); (2) the exit code is the README's: 3 (environment) with one error line on stderr, or 0
when the command reached its end state anyway (a best-effort call failed); never 1 (drift,
pending, conflict) or 2 (usage, internal error) for an I/O error; (3) leftovers: no
`*.k3patch-tmp.*` file anywhere (`__pycache__` included) unless the failed call was the removal
of that very file, or the run was killed; (4) the same command again with the fault lifted
exits 0 and ends in its end state: for apply every patched file, pycs in line, a record that
`status` reads as the reference apply's, exactly the originals' blobs and no journal; for
revert every original and no `.k3patch`. A journal before that run that it could not recover is
an unrecoverable journal; a temp file after it, or a saved copy no record names, a leftover.
"""

from __future__ import annotations

import argparse
import ast
import builtins
import ctypes
import errno
import fcntl
import hashlib
import importlib
import importlib.util
import io
import json
import marshal
import os
import pickle
import pkgutil
import py_compile
import re
import runpy
import shutil
import signal
import stat
import struct
import subprocess
import sys
import tempfile
import time
import traceback
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "RELIABILITY.md"
TEMP = re.compile(r"\.k3patch-tmp\.[0-9a-f]+$")
TEMP_IN_TEXT = re.compile(r"\.k3patch-tmp\.[0-9a-f]+")  # a temp name inside a message
KINDS = ("ENOSPC", "disk full", "EIO", "EACCES/EPERM", "kill")
COMMANDS = ("apply", "revert", "recover-apply", "recover-revert")
TREES = ("0.31.0", "fork-a")
# What each command starts from, runs, and must end in once the fault is lifted.
START = {
    "apply": "fresh",
    "revert": "applied",
    "recover-apply": "apply killed",
    "recover-revert": "revert killed",
}
RUNS = {"apply": "apply", "revert": "revert", "recover-apply": "apply", "recover-revert": "revert"}
END = {"apply": "patched", "revert": "original"}
# The calls that need free space: these fail, from the first on, while the disk is full.
SPACE = {"os.write", "os.pwrite", "os.writev", "os.mkdir", "os.fsync", "os.fdatasync"}
SPACE |= {"os.setxattr", "os.link", "os.symlink", "os.posix_fallocate", "os.ftruncate"}
SPACE |= {"os.truncate", "file.write", "file.writelines", "file.flush"}
EPERM_CALLS = {"os.chown", "os.fchown", "os.lchown", "os.chmod", "os.fchmod", "os.lchmod"}
EPERM_CALLS |= {"os.setxattr", "os.removexattr", "os.utime"}


# ---------------------------------------------------------------------------------------------
# The interposer. Installed once in this process; inert until a forked child arms it.
# ---------------------------------------------------------------------------------------------
class _Armed:
    mode: str | None = None  # None (inert), "record" or "fault"
    root = ""
    count = 0
    target = 0  # the call that fails (1-based)
    kind = ""
    persistent = False  # disk full: every later space call fails too
    tripped = False
    calls: ClassVar[list[dict[str, Any]]] = []
    seen: tuple[str, str] | None = None
    log_calls = False  # a faulted run records its calls too (--check-memo)
    code_dirs: tuple[str, ...] = ()


_A = _Armed
_REAL: dict[str, Any] = {}


def _fd_path(fd: int) -> str | None:
    try:
        found = _REAL["os.readlink"](f"/proc/self/fd/{fd}")
    except (OSError, TypeError):
        return None
    return found.removesuffix(" (deleted)")


def _abs(path: Any, dir_fd: int | None) -> str | None:
    if isinstance(path, int):
        return _fd_path(path)
    try:
        text = os.fsdecode(os.fspath(path))
    except TypeError:
        return None
    if not os.path.isabs(text):
        base = _fd_path(dir_fd) if dir_fd is not None else os.getcwd()
        if base is None:
            return None
        text = os.path.join(base, text)
    return os.path.normpath(text)


def _rel(path: str | None) -> str | None:
    """`path` relative to the tree (temp names made alike), None when outside it."""
    if path is None:
        return None
    if path == _A.root:
        return "."
    if not path.startswith(_A.root + "/"):
        return None
    return TEMP.sub(".k3patch-tmp.*", path[len(_A.root) + 1 :])


def _where() -> tuple[str, str]:
    """k3patch's innermost frame (file:line function) and its k3patch callers, outermost last."""
    chain = []
    for frame, line in traceback.walk_stack(None):
        name = frame.f_code.co_filename
        if name.startswith(_A.code_dirs):
            chain.append((os.path.basename(name), line, frame.f_code.co_name))
    if not chain:
        return "?", ""
    first = chain[0]
    return f"{first[0]}:{first[1]} {first[2]}", " < ".join(c[2] for c in chain[1:6])


def _errno_for(func: str) -> int:
    if _A.kind in ("ENOSPC", "disk full"):
        return errno.ENOSPC
    if _A.kind == "EIO":
        return errno.EIO
    return errno.EPERM if func in EPERM_CALLS else errno.EACCES


def _gate(func: str, rel: str | None, space: bool) -> int | None:
    """Count a call on the tree; the errno it must fail with (after a kill, nothing returns)."""
    if _A.mode is None or rel is None:
        return None
    _A.count += 1
    if _A.mode == "record" or _A.log_calls:
        where, chain = _where()
        _A.calls.append({"func": func, "path": rel, "where": where, "chain": chain, "space": space})
        if _A.mode == "record":
            return None
    if _A.count == _A.target:
        _A.seen = (func, rel)
        if _A.kind == "kill":
            _note_hit()
            _REAL["os.kill"](os.getpid(), signal.SIGKILL)
        _A.tripped = True
        return _errno_for(func)
    if _A.persistent and _A.tripped and space:
        return errno.ENOSPC
    return None


def _note_hit() -> None:
    """What call `target` was, for the parent to hold against the recording."""
    _A.mode = None
    with _REAL["builtins.open"](os.path.join(os.environ["K3FAULTS_OUT"], "hit.json"), "w") as out:
        json.dump(_A.seen, out)


def _raise(err: int, path: str | None) -> None:
    raise OSError(err, os.strerror(err), path)


def _wrap_os(name: str, fds: tuple[int, ...] = (), paths: tuple[tuple[int, str, str], ...] = ()):
    """os.<name>: `fds` are positions of descriptors, `paths` (position, keyword, dir_fd keyword)
    of paths (an int there is a descriptor too)."""
    real = getattr(os, name)
    func = f"os.{name}"
    _REAL[func] = real

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if _A.mode is None:
            return real(*args, **kwargs)
        found = []
        for pos in fds:
            if pos < len(args):
                found.append(_fd_path(args[pos]))
        for pos, key, dir_key in paths:
            value = args[pos] if pos < len(args) else kwargs.get(key)
            if value is not None:
                found.append(_abs(value, kwargs.get(dir_key)))
        rels = [r for r in map(_rel, found) if r is not None]
        if not rels:
            return real(*args, **kwargs)
        space = func in SPACE or (name == "open" and bool(_flags(args, kwargs) & os.O_CREAT))
        err = _gate(func, " -> ".join(rels), space)
        if err is not None:
            if name == "close":  # Linux releases the descriptor whatever close reports
                real(*args, **kwargs)
            _raise(err, found[-1])
        return real(*args, **kwargs)

    wrapper.__name__ = name
    setattr(os, name, wrapper)


def _flags(args: tuple[Any, ...], kwargs: dict[str, Any]) -> int:
    value = args[1] if len(args) > 1 else kwargs.get("flags", 0)
    return value if isinstance(value, int) else 0


class _File:
    """A file object of the tree: its reads, writes, flushes and closes are calls."""

    def __init__(self, real: Any, rel: str, writable: bool) -> None:
        object.__setattr__(self, "_real", real)
        object.__setattr__(self, "_rel", rel)
        object.__setattr__(self, "_writable", writable)

    def _call(self, method: str, *args: Any) -> Any:
        func = f"file.{method}"
        space = func in SPACE or (method == "close" and self._writable)
        err = _gate(func, self._rel, space)
        if err is not None:
            if method == "close":
                self._real.close()
            _raise(err, getattr(self._real, "name", None))
        return getattr(self._real, method)(*args)

    def read(self, *a: Any) -> Any:
        return self._call("read", *a)

    def readinto(self, *a: Any) -> Any:
        return self._call("readinto", *a)

    def readline(self, *a: Any) -> Any:
        return self._call("readline", *a)

    def readlines(self, *a: Any) -> Any:
        return self._call("readlines", *a)

    def write(self, *a: Any) -> Any:
        return self._call("write", *a)

    def writelines(self, *a: Any) -> Any:
        return self._call("writelines", *a)

    def flush(self) -> Any:
        return self._call("flush")

    def close(self) -> Any:
        return self._call("close")

    def __enter__(self) -> _File:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __iter__(self) -> Any:
        return iter(self._call("readlines"))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self._real, name, value)


def _wrap_open(owner: Any) -> None:
    real = _REAL["builtins.open"]

    def wrapper(file: Any, mode: str = "r", *args: Any, **kwargs: Any) -> Any:
        if _A.mode is None:
            return real(file, mode, *args, **kwargs)
        path = _abs(file, None)
        rel = _rel(path)
        if rel is None:
            return real(file, mode, *args, **kwargs)
        writes = any(c in mode for c in "wax+")
        # A new file by name needs space; an open of a descriptor allocates nothing.
        creates = not isinstance(file, int) and any(c in mode for c in "wxa")
        err = _gate("open", rel, creates)
        if err is not None:
            _raise(err, path)
        return _File(real(file, mode, *args, **kwargs), rel, writes)

    owner.open = wrapper


class _CFunction:
    """A libc function fetched through ctypes (CDLL(...).renameat2): its calls on the tree
    count; a failure sets ctypes' errno and returns -1, as libc does."""

    # name -> positions of (dir_fd, path) pairs, or of a plain path (dir_fd None)
    PATHS: ClassVar[dict[str, tuple[tuple[int | None, int], ...]]] = {
        "renameat2": ((0, 1), (2, 3)),
        "renameat": ((0, 1), (2, 3)),
        "rename": ((None, 0), (None, 1)),
        "unlinkat": ((0, 1),),
        "openat": ((0, 1),),
    }

    def __init__(self, real: Any, name: str) -> None:
        object.__setattr__(self, "_real", real)
        object.__setattr__(self, "_name", name)

    def __call__(self, *args: Any) -> Any:
        if _A.mode is not None:
            found = [
                _abs(args[p], None if d is None else args[d])
                for d, p in self.PATHS[self._name]
                if p < len(args)
            ]
            rels = [r for r in map(_rel, found) if r is not None]
            if rels:
                err = _gate(f"libc.{self._name}", " -> ".join(rels), False)
                if err is not None:
                    ctypes.set_errno(err)
                    return -1
        return self._real(*args)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self._real, name, value)


def install() -> None:
    """Put the wrappers in place (inert until a child arms them)."""
    _REAL["os.kill"] = os.kill
    _REAL["builtins.open"] = builtins.open
    for name in ("close", "read", "write", "pread", "pwrite", "readv", "writev", "fsync"):
        _wrap_os(name, fds=(0,))
    for name in ("fdatasync", "fstat", "fchmod", "fchown", "ftruncate", "fstatvfs"):
        _wrap_os(name, fds=(0,))
    if hasattr(os, "posix_fallocate"):
        _wrap_os("posix_fallocate", fds=(0,))
    _wrap_os("sendfile", fds=(0, 1))
    _wrap_os("copy_file_range", fds=(0, 1))
    one = ((0, "path", "dir_fd"),)
    for name in ("open", "stat", "lstat", "access", "chmod", "chown", "lchown", "mkdir"):
        _wrap_os(name, paths=one)
    for name in ("rmdir", "unlink", "remove", "readlink", "utime", "truncate", "mkfifo"):
        _wrap_os(name, paths=one)
    for name in ("listdir", "scandir", "statvfs", "getxattr", "setxattr", "listxattr"):
        _wrap_os(name, paths=((0, "path", ""),))
    _wrap_os("removexattr", paths=((0, "path", ""),))
    two = ((0, "src", "src_dir_fd"), (1, "dst", "dst_dir_fd"))
    for name in ("rename", "replace", "link", "symlink"):
        _wrap_os(name, paths=two)
    _wrap_open(builtins)
    io.open = builtins.open  # pathlib opens through io.open
    real_flock = fcntl.flock

    def flock(fd: Any, operation: int) -> Any:
        if _A.mode is not None:
            fileno = fd if isinstance(fd, int) else fd.fileno()
            err = _gate("fcntl.flock", _rel(_fd_path(fileno)), False)
            if err is not None:
                _raise(err, _fd_path(fileno))
        return real_flock(fd, operation)

    fcntl.flock = flock
    real_getitem = ctypes.CDLL.__getitem__

    def getitem(self: Any, name: Any) -> Any:
        found = real_getitem(self, name)
        return _CFunction(found, name) if name in _CFunction.PATHS else found

    ctypes.CDLL.__getitem__ = getitem  # type: ignore[method-assign]


# ---------------------------------------------------------------------------------------------
# The memo: the planning (libcst rewrite of each patch) computed once per input, in the server.
# ---------------------------------------------------------------------------------------------
class _Memo:
    """The planning of a run is pure given the bytes of the files it reads: `scan.classify`
    (ast parse and site matching of one patch), `engine._rewrite` (one patch's libcst rewrite,
    source text to new text), `engine._check` (compile and re-classify the new text) and
    `transaction._site_verdicts` (revert's and recovery's classify of a saved copy). They
    are most of a run's CPU (about 2 of 2.5 CPU-s of an apply) and make no filesystem call of
    their own beyond the reads of `sources`, which is lazy (a file is read the first time
    something asks for it). A child computes each once per input and hands it to the server
    (memo.pickle), whose later children inherit it. A hit makes the very reads the computation
    made (`sources[rel]` for each file it read first, in order), and is used only when those
    reads return the bytes they returned then; otherwise it is computed. So a run makes the
    same calls with the memo as without: `--check-memo` records each row both ways and
    compares the call lists, and tests/test_faults.py fails if they differ."""

    on = True
    entries: ClassVar[dict[str, tuple[tuple[tuple[str, str], ...], Any]]] = {}
    new: ClassVar[dict[str, tuple[tuple[tuple[str, str], ...], Any]]] = {}
    modules: ClassVar[set[str]] = set()
    hits: ClassVar[Counter[str]] = Counter()  # in this child
    misses: ClassVar[Counter[str]] = Counter()
    total_hits: ClassVar[Counter[str]] = Counter()  # in the server: every child's, summed
    total_misses: ClassVar[Counter[str]] = Counter()


def _digest(data: bytes | None) -> str:
    return "absent" if data is None else hashlib.sha256(data).hexdigest()


def _memoized(name: str, real: Any, sources_at: int, copy: Any) -> Any:
    """`real` memoized on its arguments' repr (but the Sources at `sources_at`) and the digests
    of the files the Sources had read."""

    def memo(*args: Any) -> Any:
        if not _Memo.on:
            return real(*args)
        sources = args[sources_at]
        known = dict(sources._files)  # read before: no call reads them again
        inputs = sorted((rel, _digest(f.data)) for rel, f in known.items())
        rest = [a for i, a in enumerate(args) if i != sources_at]
        key = hashlib.sha256(repr((name, sources.version, _key(rest), inputs)).encode()).hexdigest()
        found = _Memo.entries.get(key)
        if found is not None:
            reads, result = found
            if all(_digest(sources[rel].data) == digest for rel, digest in reads):
                _Memo.hits[name] += 1
                return copy(result)
            # Other bytes than when computed: compute (the reads are made already).
        _Memo.misses[name] += 1
        result = real(*args)
        reads = tuple(
            (rel, _digest(f.data)) for rel, f in sources._files.items() if rel not in known
        )
        _Memo.entries[key] = _Memo.new[key] = (reads, copy(result))
        return result

    memo.__name__ = getattr(real, "__name__", name)
    return memo


def install_memo() -> None:
    """Memoize the planning in k3patch's modules (where the callers look the names up)."""
    from k3patch import engine, scan, transaction

    classify = _memoized("classify", scan.classify, 1, list)
    scan.classify = engine.classify = classify  # type: ignore[attr-defined]
    engine._rewrite = _memoized("rewrite", engine._rewrite, 1, dict)
    engine._check = _memoized(
        "check", engine._check, 2, lambda found: {k: list(v) for k, v in found.items()}
    )
    # Revert's and recovery's check that a saved copy holds the same sites as the file it goes
    # back to (transaction.moves_only_sites): one patch's classify of two byte sets, pure too.
    transaction._site_verdicts = _memoized(
        "site_verdicts",
        transaction._site_verdicts,
        1,
        lambda found: found if isinstance(found, str) else dict(found),
    )
    if os.environ.get("K3FAULTS_PLANTED_MEMO"):
        # tests/test_faults.py: a memo that skips calls (it keeps the files' hashes by name, so
        # a hit reads nothing) must be reported by the comparison.
        real_hashes = scan.file_hashes

        def file_hashes(sources: Any, files: Any) -> Any:
            files = tuple(files)
            key = f"planted {files}"
            if _Memo.on and key in _Memo.entries:
                return dict(_Memo.entries[key][1])
            found = real_hashes(sources, files)
            _Memo.entries[key] = _Memo.new[key] = ((), dict(found))
            return found

        scan.file_hashes = file_hashes


def _key(value: Any) -> Any:
    """A stable stand-in for an argument's repr: a patch by its id (its repr would be an
    address), a set sorted, containers element by element."""
    if hasattr(value, "classify") and hasattr(value, "rewrite") and hasattr(value, "id"):
        return ("patch", value.id)
    if isinstance(value, set | frozenset):
        return ("set", sorted(map(repr, value)))
    if isinstance(value, tuple | list) and not hasattr(value, "_fields"):
        return (type(value).__name__, [_key(v) for v in value])
    if isinstance(value, dict):
        return ("dict", [(_key(k), _key(v)) for k, v in value.items()])
    return value


def _memo_out(out: Path) -> None:
    # The modules a run imported that the server has not: the server imports them after the
    # run, so later children start warm (typer's adapters import pydantic: 0.3 CPU-s a run).
    new = [name for name in sys.modules if name not in _Memo.modules]
    if new:
        with open(out / "modules.json", "w") as handle:
            json.dump(new, handle)
    with open(out / "memo.pickle", "wb") as handle:
        pickle.dump((_Memo.new, _Memo.hits, _Memo.misses), handle)


def _memo_in(out: Path) -> None:
    for name in _read_json(out / "modules.json") or []:
        if name not in sys.modules and not name.startswith("__main__"):
            with _suppress_all():
                importlib.import_module(name)
    _Memo.modules = set(sys.modules)
    try:
        with open(out / "memo.pickle", "rb") as handle:
            new, hits, misses = pickle.load(handle)
    except (OSError, EOFError, pickle.UnpicklingError, ValueError):
        return
    _Memo.entries.update(new)
    _Memo.total_hits.update(hits)
    _Memo.total_misses.update(misses)


# ---------------------------------------------------------------------------------------------
# The fork server: one child per run.
# ---------------------------------------------------------------------------------------------
def preload() -> None:
    """Import what a run imports (so each fork starts warm): k3patch, the CLI, the codemods and
    every patch module."""
    import k3patch
    import k3patch.patches

    for name in ("cli", "engine", "codemod", "fastpath", "transaction", "exitcodes", "render"):
        importlib.import_module(f"k3patch.{name}")
    for info in pkgutil.walk_packages(k3patch.patches.__path__, "k3patch.patches."):
        if not info.name.endswith(".probe"):
            importlib.import_module(info.name)
    _A.code_dirs = (
        os.path.dirname(k3patch.__file__ or "") + "/",
        os.path.dirname(k3patch.patches.__file__ or "") + "/",
    )


@dataclass
class RunResult:
    code: int | None  # exit code; None when killed
    signal: int | None
    stdout: str
    stderr: str
    calls: list[dict[str, Any]]
    seen: tuple[str, str] | None  # the call that failed, as the child met it
    count: int  # calls on the tree the child made


def run(
    args: list[str],
    site: Path,
    out: Path,
    *,
    mode: str | None = None,
    target: int = 0,
    kind: str = "",
    timeout: int = 120,
    log_calls: bool = False,
    memo: bool | None = None,
) -> RunResult:
    """`k3patch ARGS --vllm SITE` in a forked child, as `python -m k3patch` runs it."""
    out.mkdir(parents=True, exist_ok=True)
    for name in ("stdout", "stderr", "hit.json", "calls.json", "memo.pickle", "modules.json"):
        with _suppress():
            os.unlink(out / name)
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:  # the child
        code = 99
        try:
            os.environ["K3FAULTS_OUT"] = str(out)
            signal.alarm(timeout)  # a hang dies of SIGALRM, counted
            for fd, name in ((1, "stdout"), (2, "stderr")):
                got = os.open(out / name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
                os.dup2(got, fd)
                os.close(got)
            _A.root = os.path.realpath(site)
            _A.mode, _A.target, _A.kind = mode, target, kind
            _A.log_calls = log_calls
            if memo is not None:
                _Memo.on = memo
            _A.persistent = kind == "disk full"
            sys.argv = ["k3patch", *args, "--vllm", str(site)]
            try:
                runpy.run_module("k3patch", run_name="__main__", alter_sys=True)
                code = 0
            except SystemExit as exc:
                code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 2)
            mode_was, _A.mode = _A.mode, None
            _memo_out(out)
            with open(out / "calls.json", "w") as handle:
                json.dump({"calls": _A.calls, "count": _A.count}, handle)
            if mode_was == "fault" and _A.seen is not None:
                with open(out / "hit.json", "w") as handle:
                    json.dump(_A.seen, handle)
        except BaseException:
            _A.mode = None
            traceback.print_exc()
            code = 98  # the harness itself failed in the child
        finally:
            with _suppress():
                sys.stdout.flush()
                sys.stderr.flush()
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    code = os.waitstatus_to_exitcode(status)
    _memo_in(out)
    done = _read_json(out / "calls.json") or {}
    seen = _read_json(out / "hit.json")
    return RunResult(
        code=None if code < 0 else code,
        signal=-code if code < 0 else None,
        stdout=(out / "stdout").read_text(errors="replace"),
        stderr=(out / "stderr").read_text(errors="replace"),
        calls=done.get("calls", []),
        seen=tuple(seen) if seen else None,
        count=done.get("count", 0),
    )


class _suppress:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: Any) -> bool:
        return exc[0] is not None and issubclass(exc[0], OSError | ValueError)


class _suppress_all:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: Any) -> bool:
        return exc[0] is not None and issubclass(exc[0], Exception)


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


# ---------------------------------------------------------------------------------------------
# Trees: a real tree with bytecode, and what it must look like before and after.
# ---------------------------------------------------------------------------------------------
def _source_tree(name: str) -> Path:
    sys.path.insert(0, str(ROOT / "tests"))
    try:
        import conftest

        if name.startswith("fork-"):
            return conftest.built_fork_tree(name.removeprefix("fork-"))
        return conftest.pristine_tree(name)
    finally:
        sys.path.remove(str(ROOT / "tests"))


def make_tree(name: str, dest: Path) -> Path:
    """A campaign tree: what the engine reads of tree `name` (as conftest.make_tree copies it),
    with bytecode as images carry it. 0.31.0: unchecked-hash pycs of every target (an image
    built with `compileall --invalidation-mode unchecked-hash`), another interpreter's pyc
    beside one, a user xattr on one, every file owned by uid 1000 (root applying on a user's
    venv: each replacement is chowned). Fork trees: timestamp pycs (pip's), a checked-hash
    opt-1 pyc beside one, owned by root."""
    from k3patch.registry import all_patches
    from k3patch.scan import target_files

    sys.path.insert(0, str(ROOT / "tests"))
    try:
        from conftest import _copy_minimal
    finally:
        sys.path.remove(str(ROOT / "tests"))
    targets = target_files(all_patches())
    _copy_minimal(_source_tree(name), dest, targets)
    pkg = dest / "vllm"
    present = [rel for rel in targets if (pkg / rel).is_file()]
    tag = sys.implementation.cache_tag
    for i, rel in enumerate(present):
        source = pkg / rel
        cache = source.parent / "__pycache__"
        if name.startswith("fork-"):
            py_compile.compile(str(source), str(cache / f"{source.stem}.{tag}.pyc"), doraise=True)
            if i == 0:
                py_compile.compile(
                    str(source),
                    str(cache / f"{source.stem}.{tag}.opt-1.pyc"),
                    doraise=True,
                    optimize=1,
                    invalidation_mode=py_compile.PycInvalidationMode.CHECKED_HASH,
                )
        else:
            mode = py_compile.PycInvalidationMode.UNCHECKED_HASH
            pyc = cache / f"{source.stem}.{tag}.pyc"
            py_compile.compile(str(source), str(pyc), doraise=True, invalidation_mode=mode)
            if i == 0:
                shutil.copyfile(pyc, cache / f"{source.stem}.cpython-399.pyc")
                os.setxattr(source, "user.k3patch-faults", b"kept")
    if not name.startswith("fork-"):
        for path in [dest, *dest.rglob("*")]:
            os.lchown(path, 1000, 1000)
    return dest


def copy_tree(src: Path, dst: Path) -> Path:
    """A copy that keeps owners, modes, times and xattrs (timestamp pycs stay valid), as
    `cp -a` makes it, in this process (a `cp` per run cost a fork and exec of this large
    process; `fingerprint` of the two is equal: tests/test_faults.py)."""
    if dst.exists():
        shutil.rmtree(dst)
    _copy_entry(str(src), str(dst))
    return dst


def _copy_entry(src: str, dst: str) -> None:
    st = os.lstat(src)
    if stat.S_ISLNK(st.st_mode):
        os.symlink(os.readlink(src), dst)
    elif stat.S_ISDIR(st.st_mode):
        os.mkdir(dst)
        with os.scandir(src) as entries:
            for entry in entries:
                _copy_entry(entry.path, os.path.join(dst, entry.name))
    elif stat.S_ISREG(st.st_mode):
        with open(src, "rb") as source, open(dst, "wb") as target:
            target.write(source.read())
    else:
        raise ValueError(f"{src}: not a file, directory or link")
    for name in os.listxattr(src, follow_symlinks=False):
        os.setxattr(dst, name, os.getxattr(src, name, follow_symlinks=False), follow_symlinks=False)
    os.lchown(dst, st.st_uid, st.st_gid)
    if not stat.S_ISLNK(st.st_mode):
        os.chmod(dst, stat.S_IMODE(st.st_mode))
    os.utime(dst, ns=(st.st_atime_ns, st.st_mtime_ns), follow_symlinks=False)


_SNAPSHOT: dict[tuple[str, str], Any] = {}


def of_snapshot(what: Any, snap: Path) -> Any:
    """`what(snap)` for a start snapshot, computed once (a snapshot is never written after
    `prepare`, which forgets these)."""
    key = (what.__name__, str(snap))
    if key not in _SNAPSHOT:
        _SNAPSHOT[key] = what(snap)
    return _SNAPSHOT[key]


def file_hashes(site: Path) -> dict[str, str]:
    """Every file of the tree but k3patch's own state, bytecode and temp files."""
    out = {}
    for path in sorted(site.rglob("*")):
        rel = path.relative_to(site).as_posix()
        if "/.k3patch" in f"/{rel}" or "__pycache__" in rel or TEMP.search(path.name):
            continue
        if path.is_file() and not path.is_symlink():
            out[rel] = hashlib.sha256(path.read_bytes()).hexdigest()
    return out


def fingerprint(site: Path) -> list[tuple[Any, ...]]:
    """Everything a run could have changed: each entry's name, type, owner, mode, times and
    bytes (xattrs of the targets too)."""
    out: list[tuple[Any, ...]] = []
    for path in sorted(site.rglob("*")):
        st = path.lstat()
        entry: tuple[Any, ...] = (path.relative_to(site).as_posix(), st.st_mode, st.st_uid)
        entry += (st.st_gid, st.st_mtime_ns)
        if path.is_file() and not path.is_symlink():
            entry += (hashlib.sha256(path.read_bytes()).hexdigest(), tuple(os.listxattr(path)))
        out.append(entry)
    return out


_COMPILED: dict[tuple[str, str, int], Any] = {}


def pyc_problems(site: Path) -> list[str]:
    """Each pyc this interpreter would load instead of compiling its source (timestamp and size
    match, checked hash matches, or unchecked hash) must hold its source's code, and load."""
    problems = []
    tag = sys.implementation.cache_tag
    for pyc in sorted(site.rglob(f"__pycache__/*.{tag}*.pyc")):
        if TEMP.search(pyc.name):
            continue
        stem, _, rest = pyc.name.partition(f".{tag}")
        opt = int(rest.removeprefix(".opt-").removesuffix(".pyc") or 0) if ".opt-" in rest else 0
        source = pyc.parent.parent / f"{stem}.py"
        if not source.is_file():
            continue
        data, src = pyc.read_bytes(), source.read_bytes()
        if len(data) < 16 or data[:4] != importlib.util.MAGIC_NUMBER:
            continue  # read as invalid: the interpreter compiles the source
        flags = int.from_bytes(data[4:8], "little")
        if flags == 0:
            st = source.stat()
            key = struct.pack("<II", int(st.st_mtime) & 0xFFFFFFFF, st.st_size & 0xFFFFFFFF)
            used = data[8:16] == key
        elif flags == 1:
            used = True  # unchecked: loaded whatever the source holds
        else:
            used = data[8:16] == importlib.util.source_hash(src)
        if not used:
            continue
        rel = pyc.relative_to(site).as_posix()
        pair = (hashlib.sha256(data).hexdigest(), hashlib.sha256(src).hexdigest(), opt)
        if pair not in _JUDGED:  # the same pyc bytes against the same source: one verdict
            _JUDGED[pair] = _pyc_verdict(data, src, opt)
        if _JUDGED[pair] == "unmarshal":
            problems.append(f"{rel} would be loaded and does not unmarshal")
        elif _JUDGED[pair] == "other":
            mode = {0: "timestamp", 1: "unchecked-hash"}.get(flags, "checked-hash")
            problems.append(f"{rel} ({mode}) would run other code than {stem}.py holds")
    return problems


_JUDGED: dict[tuple[str, str, int], str] = {}


def _pyc_verdict(data: bytes, src: bytes, opt: int) -> str:
    """ "ok", "unmarshal" (it does not load) or "other" (it holds other code than `src`)."""
    try:
        code = marshal.loads(data[16:])
    except (EOFError, ValueError, TypeError):
        return "unmarshal"
    key3 = (hashlib.sha256(src).hexdigest(), code.co_filename, opt)
    if key3 not in _COMPILED:
        try:
            _COMPILED[key3] = compile(
                src, code.co_filename, "exec", dont_inherit=True, optimize=opt
            )
        except (SyntaxError, ValueError):
            _COMPILED[key3] = None
    return "ok" if _COMPILED[key3] == code else "other"


@dataclass
class Reference:
    """A tree's original and patched states, from uninterrupted runs."""

    original: dict[str, str]
    patched: dict[str, str]
    changed: list[str]  # files apply rewrites (relative to the site dir)
    patches_of: dict[str, list[str]]
    blobs: set[str]  # the saved copies an applied tree keeps: the changed files' originals
    status: dict[str, tuple[int, dict[str, str]]]  # end state -> (status code, verdicts)


def status_of(site: Path, out: Path) -> tuple[int | None, dict[str, str], str]:
    got = run(["status", "--json"], site, out)
    try:
        data = json.loads(got.stdout)
        verdicts = {p["id"]: p["verdict"] for p in data["patches"]}
        return got.code, verdicts, str(data.get("interrupted"))
    except (ValueError, KeyError, TypeError):
        return got.code, {}, got.stderr.strip()[-200:]


@dataclass
class Row:
    command: str
    tree: str
    calls: int = 0
    space_calls: int = 0
    runs: Counter[str] = field(default_factory=Counter)
    failures: Counter[str] = field(default_factory=Counter)
    mismatched: int = 0  # runs whose call N was not the recorded one (the harness's doubt)
    examples: list[dict[str, Any]] = field(default_factory=list)
    call_kinds: Counter[str] = field(default_factory=Counter)
    seconds: float = 0.0
    memo_checked: bool = False  # the recording made the same calls with and without the memo
    cpu: float = 0.0  # CPU seconds of the server and its children (the runs, cp, ...)


def cpu_seconds() -> float:
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


FAILURE_KINDS = ("half-patched", "unrecoverable journal", "leftovers", "wrong exit code")
FAILURE_KINDS += ("wrong end state",)


class Campaign:
    def __init__(self, work: Path, verbose: bool = False, check_memo: bool = False) -> None:
        self.work = work
        self.verbose = verbose
        self.check_memo = check_memo  # every faulted run also without the memo, compared
        self.memo_differences: list[str] = []

    # -- set-up --------------------------------------------------------------------------
    def prepare(self, tree: str, commands: list[str]) -> tuple[dict[str, Path], Reference]:
        """The start snapshot of each of `commands` on `tree`, and the tree's reference. A
        recovery starts from the uninterrupted run killed right after its first target file
        was swapped in (a journal, saved copies, one file written)."""
        base = self.work / f"{tree}-start"
        snaps: dict[str, Path] = {}
        _SNAPSHOT.clear()
        if base.exists():
            shutil.rmtree(base)
        base.mkdir(parents=True)
        out = self.work / "out"
        snaps["fresh"] = make_tree(tree, base / "fresh")
        original = file_hashes(snaps["fresh"])
        status_original = status_of(copy_tree(snaps["fresh"], self.work / "scratch"), out)
        snaps["applied"] = copy_tree(snaps["fresh"], base / "applied")
        applied = run(["apply"], snaps["applied"], out, mode="record")
        if applied.code != 0:
            raise SystemExit(f"{tree}: a clean apply exited {applied.code}: {applied.stderr}")
        patched = file_hashes(snaps["applied"])
        record = json.loads((snaps["applied"] / "vllm/.k3patch/state.json").read_text())
        changed = sorted(rel for rel in original if patched.get(rel) != original[rel])
        patches_of = {
            f"vllm/{rel}": fs["patches"] for rel, fs in record["files"].items() if fs["applied"]
        }
        status_patched = status_of(copy_tree(snaps["applied"], self.work / "scratch"), out)
        for command in commands:
            start = START[command]
            if start in snaps:
                continue
            source, op = ("fresh", "apply") if start == "apply killed" else ("applied", "revert")
            calls = run([op], copy_tree(snaps[source], self.work / "scratch"), out, mode="record")
            n = _mid_commit(calls.calls, changed)
            snaps[start] = copy_tree(snaps[source], base / start.replace(" ", "-"))
            got = run([op], snaps[start], out, mode="fault", target=n, kind="kill")
            journal = snaps[start] / "vllm/.k3patch/journal.json"
            if got.signal != signal.SIGKILL or not journal.exists():
                raise SystemExit(f"{tree}: {op} killed at call {n} left no journal")
        ref = Reference(
            original,
            patched,
            changed,
            patches_of,
            {original[rel] for rel in changed},
            {
                "original": (status_original[0], status_original[1]),
                "patched": (status_patched[0], status_patched[1]),
            },
        )
        return snaps, ref

    # -- one run -------------------------------------------------------------------------
    def half(self, site: Path, ref: Reference, journal_excuses: bool) -> list[str]:
        now = file_hashes(site)
        problems = []
        states = {}
        for rel in sorted(set(now) | set(ref.original)):
            if rel in ref.changed:
                got = now.get(rel)
                states[rel] = (
                    "original"
                    if got == ref.original[rel]
                    else "patched"
                    if got == ref.patched[rel]
                    else "neither"
                )
            elif now.get(rel) != ref.original.get(rel):
                problems.append(f"{rel} changed (apply does not write it)")
        kinds = set(states.values())
        if "neither" in kinds:
            problems += [
                f"{rel} is neither original nor patched"
                for rel, s in states.items()
                if s == "neither"
            ]
        if len(kinds - {"neither"}) > 1 and not journal_excuses:
            per_patch = {}
            for rel, s in states.items():
                for pid in ref.patches_of.get(rel, ["?"]):
                    per_patch.setdefault(pid, set()).add(s)
            split = ", ".join(f"{p}: {'/'.join(sorted(s))}" for p, s in sorted(per_patch.items()))
            problems.append(f"files split between original and patched ({split})")
        if not journal_excuses:
            problems += pyc_problems(site)
        return problems

    def end_state(self, site: Path, ref: Reference, end: str) -> tuple[list[str], list[str]]:
        """(wrong end state, leftovers) of a tree that must be `end` now."""
        wrong: list[str] = []
        left: list[str] = []
        want = ref.patched if end == "patched" else ref.original
        now = file_hashes(site)
        diff = sorted(rel for rel in set(now) | set(want) if now.get(rel) != want.get(rel))
        if diff:
            wrong.append(f"not {end}: {', '.join(diff[:3])}")
        wrong += pyc_problems(site)
        state_dir = site / "vllm" / ".k3patch"
        if (state_dir / "journal.json").exists():
            wrong.append("a journal is left")
        if end == "original":
            if state_dir.exists():
                left.append(f".k3patch left: {sorted(p.name for p in state_dir.rglob('*'))[:4]}")
        else:
            blobs = {p.name for p in (state_dir / "blobs").glob("*")}
            if ref.blobs - blobs:
                wrong.append(f"saved originals missing: {len(ref.blobs - blobs)}")
            if blobs - ref.blobs:
                left.append(f"{len(blobs - ref.blobs)} saved copies no record needs")
        left += [p.relative_to(site).as_posix() for p in site.rglob("*") if TEMP.search(p.name)]
        code, verdicts, interrupted = status_of(site, self.work / "out")
        want_code, want_verdicts = ref.status[end]
        if (code, verdicts) != (want_code, want_verdicts):
            wrong.append(f"status says {code} {verdicts} ({interrupted}), not {want_code}")
        return wrong, left

    def one(
        self, command: str, snap: Path, ref: Reference, n: int, kind: str, expect: dict[str, Any]
    ) -> tuple[dict[str, list[str]], bool]:
        """Run `command` with call `n` failing as `kind`, check, lift, check. Returns the
        problems per failure kind, and whether call n was the recorded call."""
        site = copy_tree(snap, self.work / "site")
        op, end = RUNS[command], END[RUNS[command]]
        checked = self.check_memo and kind != "kill"  # a killed run hands back no calls
        args = {"mode": "fault", "target": n, "kind": kind, "log_calls": checked}
        got = run([op], site, self.work / "out", **args)
        matched = got.seen == (expect["func"], expect["path"])
        found: dict[str, list[str]] = {k: [] for k in FAILURE_KINDS}
        if checked:
            plain = copy_tree(snap, self.work / "twin")  # as long a name: the same wrapping
            bare = run([op], plain, self.work / "out-no-memo", **args, memo=False)
            if differs := memo_difference(got, bare, site, plain):
                self.memo_differences.append(f"{command} {kind} at call {n}: {differs}")
        journal = (site / "vllm/.k3patch/journal.json").exists()
        killed = got.signal == signal.SIGKILL
        if got.code is None and not killed:
            found["wrong exit code"].append(f"died of signal {got.signal} (a hang?)")
        # A journal excuses files split between original and patched only where recovery is
        # what comes next: after a kill, or when the run left the files as it found them.
        excused = journal and (killed or file_hashes(site) == of_snapshot(file_hashes, snap))
        found["half-patched"] += self.half(site, ref, journal_excuses=excused)
        # A temp file the killed run before this one left is the recovery's to remove, and is
        # held to it after the run with the fault lifted; here only this run's own count.
        before = {p.relative_to(snap).as_posix() for p in snap.rglob("*") if TEMP.search(p.name)}
        temps = [
            p.relative_to(site).as_posix()
            for p in site.rglob("*")
            if TEMP.search(p.name) and p.relative_to(site).as_posix() not in before
        ]
        if not killed:
            failed_removal = expect["func"] in ("os.unlink", "os.remove", "libc.unlinkat")
            excused = expect["path"] if failed_removal else None
            temps = [t for t in temps if TEMP.sub(".k3patch-tmp.*", t) != excused]
            found["leftovers"] += temps
            lines = [line for line in got.stderr.splitlines() if line.strip()]
            if got.code == 0:
                wrong, left = self.end_state(site, ref, end)
                if wrong:
                    found["wrong exit code"].append(f"exit 0 but {'; '.join(wrong)}")
                found["leftovers"] += left
            elif got.code != 3:
                found["wrong exit code"].append(f"exit {got.code}: {' | '.join(lines)[:300]}")
            elif len(lines) != 1:
                found["wrong exit code"].append(
                    f"exit 3 with {len(lines)} stderr lines: {' | '.join(lines)[:300]}"
                )
        # The fault lifted: the same command again. On a tree exactly as it started (every
        # entry's name, type, owner, mode, mtime, bytes and xattrs: the tree, .k3patch and the
        # pycaches; a killed run too, whose flock died with it) that run is the uninterrupted
        # one, already checked (Campaign.row): not run again.
        if fingerprint(site) == of_snapshot(fingerprint, snap):
            return {k: v for k, v in found.items() if v}, matched
        again = run([op], site, self.work / "out")
        lines = [line for line in again.stderr.splitlines() if line.strip()]
        if again.code != 0:
            what = "unrecoverable journal" if journal else "wrong end state"
            found[what].append(f"then {op} exited {again.code}: {' | '.join(lines)[:300]}")
        else:
            wrong, left = self.end_state(site, ref, end)
            found["wrong end state"] += wrong
            found["leftovers"] += left
        return {k: v for k, v in found.items() if v}, matched

    # -- a row ---------------------------------------------------------------------------
    def row(
        self,
        command: str,
        tree: str,
        snaps: dict[str, Path],
        ref: Reference,
        kinds: list[str],
        every: int = 1,
        offset: int = 0,
        only_call: int | None = None,
        funcs: set[str] | None = None,
        replay: list[dict[str, Any]] | None = None,
    ) -> Row:
        start, cpu = time.perf_counter(), cpu_seconds()
        snap = snaps[START[command]]
        recorded = run(
            [RUNS[command]], copy_tree(snap, self.work / "site"), self.work / "out", mode="record"
        )
        calls = recorded.calls
        row = Row(command, tree, calls=len(calls), space_calls=sum(c["space"] for c in calls))
        # The memo proves itself on every row: the recording again with the memo warm, and
        # without it, make the very calls of the first (tests/test_faults.py holds this).
        for memo in (True, False):
            again = copy_tree(snap, self.work / "twin")
            other = run([RUNS[command]], again, self.work / "out", mode="record", memo=memo)
            if differs := memo_difference(recorded, other, self.work / "site", again):
                what = "warm memo" if memo else "no memo"
                self.memo_differences.append(f"{command} on {tree}, {what}: {differs}")
        mine = f"{command} on {tree}"
        row.memo_checked = not any(d.startswith(mine) for d in self.memo_differences)
        row.call_kinds.update(c["func"] for c in calls)
        # The uninterrupted run: what a run on a tree left as it started would do.
        wrong, left = self.end_state(self.work / "site", ref, END[RUNS[command]])
        if recorded.code != 0 or wrong or left:
            row.failures["wrong end state"] += 1
            problems = {"wrong end state": [f"exit {recorded.code}", *wrong, *left]}
            row.examples.append({"kind": "none", "call": 0, "problems": problems})
        # --replay: the failing runs of an earlier campaign, found again by what the call was
        # (function, path, k3patch function and callers), since numbers move with the code.
        wanted = {(e["kind"], _identity(e)) for e in replay or []}
        for kind in kinds:
            for n, call in enumerate(calls, 1):
                if replay is not None:
                    if (kind, _identity(call)) not in wanted:
                        continue
                elif only_call is not None and n != only_call:
                    continue
                if only_call is None and (n - 1 - offset) % every:
                    continue
                if funcs and call["func"] not in funcs:
                    continue
                if kind == "disk full" and not call["space"]:
                    continue
                problems, matched = self.one(command, snap, ref, n, kind, call)
                row.runs[kind] += 1
                if sum(row.runs.values()) % 200 == 0:
                    print(
                        f"# progress: {command} on {tree}, {kind} at call {n} of {len(calls)}, "
                        f"{sum(row.runs.values())} runs, {time.strftime('%H:%M:%S')}",
                        file=sys.stderr,
                        flush=True,
                    )
                if not matched:
                    row.mismatched += 1
                for what in problems:
                    row.failures[what] += 1
                if problems or self.verbose:
                    example = {"kind": kind, "call": n, **call, "problems": problems}
                    row.examples.append(example)
                    print(_describe(row, example), file=sys.stderr, flush=True)
        row.seconds = time.perf_counter() - start
        row.cpu = cpu_seconds() - cpu
        return row


def call_list(calls: list[dict[str, Any]]) -> list[tuple[str, str, str, str]]:
    """What a run did, call by call: function, path (temp names alike), k3patch call site and
    its callers."""
    return [(c["func"], c["path"], c["where"], c["chain"]) for c in calls]


def memo_difference(a: RunResult, b: RunResult, site_a: Path, site_b: Path) -> str:
    """How two runs of one command on two copies of one tree differ (one with the memo, one
    without): their calls, exit codes, output (temp names alike) and the trees they left."""
    if call_list(a.calls) != call_list(b.calls):
        mine, theirs = call_list(a.calls), call_list(b.calls)
        pairs = zip(mine, theirs, strict=False)
        first = next((i for i, (x, y) in enumerate(pairs) if x != y), min(len(mine), len(theirs)))
        return f"calls differ from call {first + 1} ({len(a.calls)} vs {len(b.calls)} calls)"
    if (a.code, a.signal) != (b.code, b.signal):
        return f"exit {a.code}/{a.signal} vs {b.code}/{b.signal}"
    said = [
        TEMP_IN_TEXT.sub("", (r.stdout + r.stderr).replace(str(site), "SITE"))
        for r, site in ((a, site_a), (b, site_b))
    ]
    if said[0] != said[1]:
        return f"output differs: {said[0][-300:]!r} vs {said[1][-300:]!r}"
    if file_hashes(site_a) != file_hashes(site_b):
        return "the trees differ"
    return ""


def _identity(call: dict[str, Any]) -> tuple[str, str, str, str]:
    function = call.get("where", "").rpartition(" ")[2]
    return call.get("func", ""), call.get("path", ""), function, call.get("chain", "")


def _mid_commit(calls: list[dict[str, Any]], changed: list[str]) -> int:
    """The call right after the first target file is swapped in: a kill there leaves a journal,
    saved copies and one file written."""
    names = {rel.removeprefix("vllm/") for rel in changed}
    for n, call in enumerate(calls, 1):
        if call["func"] in ("libc.renameat2", "os.replace", "os.rename"):
            dest = call["path"].split(" -> ")[-1].removeprefix("vllm/")
            if dest in names:
                return n + 1
    raise SystemExit("no target file was renamed into place in the recording")


def _describe(row: Row, example: dict[str, Any]) -> str:
    head = (
        f"{row.command} on {row.tree}: {example['kind']} at call {example['call']} "
        f"{example.get('func', '')} {example.get('path', '')} ({example.get('where', '')}"
        f"{' < ' + example['chain'] if example.get('chain') else ''})"
    )
    body = (
        "".join(
            f"\n    {what}: {'; '.join(lines)[:400]}" for what, lines in example["problems"].items()
        )
        if isinstance(example["problems"], dict)
        else ""
    )
    return head + (body or "\n    ok")


# ---------------------------------------------------------------------------------------------
# The report.
# ---------------------------------------------------------------------------------------------
BEGIN = "<!-- faults.py: begin -->"
FINISH = "<!-- faults.py: end -->"


def commit_of(src: Path) -> str:
    got = subprocess.run(
        ["git", "-C", str(src), "log", "-1", "--format=%h"], capture_output=True, text=True
    )
    dirty = subprocess.run(
        ["git", "-C", str(src), "status", "--porcelain", "--", "k3patch", "patches"],
        capture_output=True,
        text=True,
    )
    return (got.stdout.strip() or "?") + (" + uncommitted changes" if dirty.stdout.strip() else "")


def table(rows: list[Row], kinds: list[str], header: str) -> str:
    lines = [
        header,
        "",
        f"| command | tree | calls (need space) | runs: {' / '.join(kinds)} | "
        + " | ".join(FAILURE_KINDS)
        + " | wall s | CPU s |",
        "|---|---|---:|---:|" + "---:|" * len(FAILURE_KINDS) + "---:|---:|",
    ]
    for r in rows:
        runs = " / ".join(str(r.runs[k]) for k in kinds)
        fails = " | ".join(str(r.failures[k]) for k in FAILURE_KINDS)
        lines.append(
            f"| {r.command} | {r.tree} | {r.calls} ({r.space_calls or '?'}) | {runs} | {fails} | "
            f"{r.seconds:.0f} | {r.cpu:.0f} |"
        )
    total_runs = sum(sum(r.runs.values()) for r in rows)
    total = Counter()
    for r in rows:
        total.update(r.failures)
    cpu = sum(r.cpu for r in rows)
    lines.append("")
    lines.append(
        f"{total_runs} runs ({cpu:.0f} CPU-s, {cpu / max(1, total_runs):.2f} a run); failing runs "
        "by kind: "
        + ", ".join(f"{k} {total[k]}" for k in FAILURE_KINDS)
        + f"; runs whose failing call was not the recorded one: {sum(r.mismatched for r in rows)}"
        + "; rows whose recording made other calls without the memo: "
        + f"{sum(not r.memo_checked for r in rows)}."
    )
    return "\n".join(lines)


def call_table(rows: list[Row]) -> str:
    funcs = sorted({f for r in rows for f in r.call_kinds})
    lines = [
        "| call | " + " | ".join(f"{r.command} {r.tree}" for r in rows) + " |",
        "|---|" + "---:|" * len(rows),
    ]
    for func in funcs:
        lines.append(f"| `{func}` | " + " | ".join(str(r.call_kinds[func]) for r in rows) + " |")
    return "\n".join(lines)


METHOD = """\
## Fault injection: every filesystem call fails in turn (issue 26)

`benchmarks/faults.py` records every filesystem call `apply`, `revert` and the recovery of an
interrupted run make on a real tree (each `os` call, `open` and its file objects' read, write,
flush and close, `fcntl.flock`, libc `renameat2` through ctypes; a call counts when its path,
its `dir_fd` or its descriptor is under the tree), then runs the command again once per call
with that call failing: ENOSPC, a disk that stays full from that call on (ENOSPC for every later
call that needs space, rollback included), EIO, EACCES/EPERM, or SIGKILL right before it. Rows:
`apply` on a fresh tree; `revert` on an applied one; `recover-apply` / `recover-revert`: the
tree an apply / revert killed right after its first target was swapped in left (journal, saved
copies, one file written), then `apply` / `revert`. Trees: vLLM 0.31.0 (the real wheel's files,
unchecked-hash pycs, another interpreter's pyc, a user xattr, owned by uid 1000 while root runs
k3patch) and fork tree a (real 0.28.0 + the recipe's scripts; timestamp pycs and a checked-hash
opt-1 pyc; all four patches pending, two of them in one file).

A run fails as **half-patched** when a target file is neither its original nor its patched
bytes, or the files are split between the two (apply is one transaction; only a journal after a
kill, or one the run found and could not get past, excuses a split until the next run), or a
pyc the interpreter would load holds other code than its source; **unrecoverable journal** when
the command run again with the fault lifted does not exit 0 past the journal the faulted run
left; **leftovers** when a `*.k3patch-tmp.*` file is left (anywhere, `__pycache__` included) by
the faulted run (unless its failed call was that file's removal) or after the run again, or
saved copies no record needs, or a `.k3patch` after a revert; **wrong exit code** when a faulted
run exits other than 3 with one stderr line (or 0 having reached its end state anyway); **wrong
end state** when the run again does not end applied (apply: patched files, pycs in line, the
reference's `status`, exactly the originals' saved copies) or original (revert: no `.k3patch`).

What makes every call affordable (2 shared cores): the runs are forked from a server that has
imported everything a run imports, and the planning (each patch's classification, its libcst
rewrite and the check of the new text: pure functions of the bytes they read, about 2 of an
apply's 2.5 CPU-s) is memoized there: a hit makes the very reads the computation made and is
used only if they return the same bytes, so a run makes the same filesystem calls with the
memo as without (every row's recording is compared both ways, and `tests/test_faults.py`
compares a sample of faulted runs' calls, exit codes, output and trees, and reports a planted
memo that skips reads). The run with the fault lifted is skipped only when the faulted run
(killed or not) left the tree, `.k3patch` and the pycaches exactly as the row started (every
entry's name, type, owner, mode, mtime, bytes and xattrs): that run is the row's baseline run,
checked once. A run costs 0.07-0.12 CPU-s (1.5-1.7 before; see below).
"""


def write_report(section: str) -> None:
    text = RESULTS.read_text() if RESULTS.exists() else ""
    block = f"{BEGIN}\n{METHOD}\n{section}\n{FINISH}\n"
    if BEGIN in text and FINISH in text:
        before, rest = text.split(BEGIN, 1)
        after = rest.split(FINISH, 1)[1].lstrip("\n")
        text = before + block + ("\n" + after if after else "")
    else:  # below the page's title
        title, _, rest = text.partition("\n\n") if text.startswith("# ") else ("", "", text)
        text = (title + "\n\n" if title else "") + block + "\n" + rest
    RESULTS.write_text(text)


_ROW_LINE = re.compile(
    r"^(\S+) on (\S+): (\d+) calls, runs (\{.*\}), failures (\{.*\}), (\d+)s(?:, .*)?$", re.M
)
_FAIL_LINE = re.compile(
    r"^(\S+) on (\S+): (.+?) at call (\d+) (\S+) (.*?) \((\S+ \S+)(?: < (.*))?\)$"
)


def _from_log(text: str, partial: bool = False) -> dict[str, Any]:
    """The finished rows of a run's log (its stderr), for a campaign stopped before its end:
    each row's summary line, and each failing run's lines."""
    meta = re.search(r"^# faults\.py (.*)$", text, re.M)
    data: dict[str, Any] = json.loads(meta.group(1)) if meta else {"commit": "?", "seconds": 0}
    data["rows"] = []
    examples: dict[tuple[str, str], list[dict[str, Any]]] = {}
    current: dict[str, Any] | None = None
    for line in text.splitlines():
        if found := _FAIL_LINE.match(line):
            cmd, tree, kind, n, func, path, where, chain = found.groups()
            current = {"kind": kind, "call": int(n), "func": func, "path": path}
            current.update({"where": where, "chain": chain or "", "problems": {}})
            examples.setdefault((cmd, tree), []).append(current)
        elif current is not None and line.startswith("    ") and ": " in line:
            what, _, detail = line.strip().partition(": ")
            if what in FAILURE_KINDS:
                current["problems"][what] = [detail]
    if partial:  # every row that failed a run, finished or not
        for (cmd, tree), found_there in examples.items():
            data["rows"].append({"command": cmd, "tree": tree, "examples": found_there})
        return data
    for found in _ROW_LINE.finditer(text):
        cmd, tree, calls, runs, fails, seconds = found.groups()
        row = {"command": cmd, "tree": tree, "calls": int(calls), "space_calls": 0}
        row.update({"runs": ast.literal_eval(runs), "failures": ast.literal_eval(fails)})
        row.update({"mismatched": 0, "call_kinds": {}, "seconds": float(seconds)})
        row["examples"] = examples.get((cmd, tree), [])
        data["rows"].append(row)
    return data


def report(paths: list[str], write: bool) -> int:
    """The tables of earlier runs' --json files (or logs), side by side (one campaign in
    several processes: a tree each, say)."""
    text, rows = report_text(paths)
    print(text)
    if write:
        write_report(text + "\n\nCalls recorded, by function:\n\n" + call_table(rows))
    return 0


def report_text(paths: list[str]) -> tuple[str, list[Row]]:
    rows, seen, samples, commits, seconds = [], [], set(), set(), 0.0
    repeats: list[str] = []
    for path in paths:
        text = Path(path).read_text()
        data = json.loads(text) if text.lstrip().startswith("{") else _from_log(text)
        commits.add(data["commit"])
        seconds = max(seconds, data["seconds"])
        sample = data.get("sample", {})
        every = sample.get("every", "?")
        samples.add(
            "every call"
            if every == 1
            else f"every {every}th call from call {sample.get('offset', 0) + 1}"
        )
        for raw in data["rows"]:
            twin = next(
                (r for r in rows if (r.command, r.tree) == (raw["command"], raw["tree"])), None
            )
            if (
                twin is not None
                and twin.calls == raw["calls"]
                and set(raw["runs"]) <= set(twin.runs)
            ):
                # A row's kinds an earlier file holds already, run again: the first counts.
                repeats.append(f"{raw['command']} {raw['tree']} {', '.join(sorted(raw['runs']))}")
                continue
            if (
                twin is not None
                and twin.calls == raw["calls"]
                and not set(twin.runs) & set(raw["runs"])
            ):
                # One row run in several processes, a fault kind each: one row.
                twin.runs.update(raw["runs"])
                twin.failures.update(raw["failures"])
                twin.mismatched += raw["mismatched"]
                twin.seconds = max(twin.seconds, raw.get("seconds", 0.0))
                twin.cpu += raw.get("cpu", 0.0)
                twin.memo_checked = twin.memo_checked and raw.get("memo_checked", False)
                seen += [(twin, e) for e in raw["examples"] if e.get("problems")]
                continue
            row = Row(raw["command"], raw["tree"], raw["calls"], raw["space_calls"])
            row.runs.update(raw["runs"])
            row.failures.update(raw["failures"])
            row.mismatched = raw["mismatched"]
            row.call_kinds.update(raw["call_kinds"])
            row.seconds = raw.get("seconds", 0.0)
            row.cpu = raw.get("cpu", 0.0)
            row.memo_checked = raw.get("memo_checked", False)
            rows.append(row)
            seen += [(row, e) for e in raw["examples"] if e.get("problems")]
    kinds = [k for k in KINDS if any(r.runs[k] for r in rows)]
    header = (
        f"Fault injection (`benchmarks/faults.py`) on the code of {', '.join(sorted(commits))}, "
        f"{time.strftime('%Y-%m-%d')}, {seconds / 60:.0f} min wall; sample: "
        + "; ".join(sorted(samples))
    )
    text = table(rows, kinds, header)
    if repeats:
        text += "\n\nRun twice, in two processes (the first file's runs are the ones counted): "
        text += "; ".join(repeats) + "."
    sites: Counter[tuple[str, str, str]] = Counter()
    for row, example in seen:
        for what in example["problems"]:
            where = example.get("where", "").split(" ")[-1]
            sites[
                (
                    what,
                    f"{row.command} {row.tree}",
                    f"{example['kind']} at {example.get('func', '')} ({where})",
                )
            ] += 1
    if sites:
        text += "\n\n| failure | row | fault at (k3patch function) | runs |\n|---|---|---|---:|\n"
        text += "\n".join(f"| {w} | {r} | {c} | {n} |" for (w, r, c), n in sorted(sites.items()))
    return text, rows


def write_json(
    path: Path, commit: str, args: Any, elapsed: float, rows: list[Row], campaign: Campaign
) -> None:
    """The rows so far (written after every row: a campaign stopped early keeps its rows)."""
    data = {
        "commit": commit,
        "sample": {"every": args.every, "offset": args.offset, "kinds": args.kinds},
        "seconds": elapsed,
        "memo": {
            "on": _Memo.on,
            "hits": dict(_Memo.total_hits),
            "misses": dict(_Memo.total_misses),
            "checked_runs": args.check_memo,
            "differences": campaign.memo_differences,
        },
        "rows": [
            {
                "command": r.command,
                "tree": r.tree,
                "calls": r.calls,
                "space_calls": r.space_calls,
                "runs": dict(r.runs),
                "failures": dict(r.failures),
                "mismatched": r.mismatched,
                "examples": r.examples,
                "call_kinds": dict(r.call_kinds),
                "seconds": r.seconds,
                "cpu": r.cpu,
                "memo_checked": r.memo_checked,
            }
            for r in rows
        ],
    }
    temp = path.with_name(path.name + ".part")
    temp.write_text(json.dumps(data, indent=1))
    os.replace(temp, path)


# ---------------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trees", nargs="+", default=list(TREES))
    parser.add_argument("--commands", nargs="+", default=list(COMMANDS), choices=COMMANDS)
    parser.add_argument("--kinds", nargs="+", default=list(KINDS), choices=KINDS)
    parser.add_argument("--every", type=int, default=1, help="run every K-th call only")
    parser.add_argument("--offset", type=int, default=0, help="...starting at call offset+1")
    parser.add_argument("--call", type=int, default=None, help="run call N only (a repro)")
    parser.add_argument("--funcs", nargs="+", default=None, help="only calls of these functions")
    parser.add_argument("--k3patch", default=None, help="a k3patch source dir to run instead")
    parser.add_argument("--commit", default=None, help="name the code run (default: git)")
    parser.add_argument("--work", default=None, help="scratch dir (default: a new temp dir)")
    parser.add_argument("--json", default=None, help="write rows and failures as JSON here")
    parser.add_argument("--write", action="store_true", help="write the table to RELIABILITY.md")
    parser.add_argument("--calls", action="store_true", help="print every recorded call")
    parser.add_argument("-v", "--verbose", action="store_true")
    parser.add_argument("--no-memo", action="store_true", help="plan afresh in every run")
    parser.add_argument(
        "--check-memo", action="store_true", help="run each faulted run without the memo too"
    )
    parser.add_argument("--replay", nargs="+", default=None, help="rerun these --json failures")
    parser.add_argument("--report", nargs="+", default=None, help="tables from --json files")
    args = parser.parse_args(argv)
    if args.report:
        return report(args.report, args.write)

    source = ROOT
    if args.k3patch:
        source = Path(args.k3patch).resolve()
        lib = Path(tempfile.mkdtemp(prefix="k3faults-lib-"))
        shutil.copytree(source / "k3patch", lib / "k3patch")
        shutil.copytree(source / "patches", lib / "k3patch" / "patches", dirs_exist_ok=True)
        sys.path.insert(0, str(lib))
    os.environ.update({"NO_COLOR": "1", "COLUMNS": "100", "PYTHONDONTWRITEBYTECODE": "1"})
    os.environ.pop("K3PATCH_TEST_CRASH_AT", None)
    sys.dont_write_bytecode = True
    preload()
    install()
    install_memo()
    _Memo.on = not args.no_memo
    _Memo.modules = set(sys.modules)
    work = Path(args.work or tempfile.mkdtemp(prefix="k3faults-"))
    work.mkdir(parents=True, exist_ok=True)
    os.chdir(work)  # python -m k3patch from an empty directory, as apply_sweep does
    campaign = Campaign(work, verbose=args.verbose, check_memo=args.check_memo)
    replayed: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for path in args.replay or []:
        text = Path(path).read_text()
        # A --json file, or the log (stderr) of a campaign stopped before its rows ended.
        data = json.loads(text) if text.lstrip().startswith("{") else _from_log(text, partial=True)
        for raw in data["rows"]:
            failing = [e for e in raw["examples"] if e.get("problems") and e.get("func")]
            replayed.setdefault((raw["command"], raw["tree"]), []).extend(failing)
    rows = []
    started = time.perf_counter()
    sample = {"every": args.every, "offset": args.offset, "kinds": args.kinds}
    meta = {"commit": args.commit or commit_of(source), "seconds": 0, "sample": sample}
    print(f"# faults.py {json.dumps(meta)}", file=sys.stderr, flush=True)
    for tree in args.trees:
        snaps, ref = campaign.prepare(tree, args.commands)
        for command in args.commands:
            row = campaign.row(
                command,
                tree,
                snaps,
                ref,
                args.kinds,
                every=args.every,
                offset=args.offset,
                only_call=args.call,
                funcs=set(args.funcs) if args.funcs else None,
                replay=replayed.get((command, tree), []) if args.replay else None,
            )
            rows.append(row)
            if args.json:
                elapsed = time.perf_counter() - started
                write_json(Path(args.json), meta["commit"], args, elapsed, rows, campaign)
            print(
                f"{command} on {tree}: {row.calls} calls, runs {dict(row.runs)}, "
                f"failures {dict(row.failures)}, {row.seconds:.0f}s, {row.cpu:.0f} CPU-s "
                f"({row.cpu / max(1, sum(row.runs.values())):.2f} CPU-s a run)",
                file=sys.stderr,
                flush=True,
            )
            if args.calls:
                recorded = run(
                    [RUNS[command]],
                    copy_tree(snaps[START[command]], work / "site"),
                    work / "out",
                    mode="record",
                )
                for n, c in enumerate(recorded.calls, 1):
                    print(f"{n:4d} {c['func']:<16} {c['path']:<70} {c['where']} < {c['chain']}")
    elapsed = time.perf_counter() - started
    commit = args.commit or commit_of(source)
    header = (
        f"Fault injection (`benchmarks/faults.py`), on the code of {commit}, "
        f"{time.strftime('%Y-%m-%d')}, {elapsed / 60:.0f} min"
    )
    text = table(rows, args.kinds, header)
    print(text)
    if args.json:
        write_json(Path(args.json), commit, args, elapsed, rows, campaign)
    if args.write:
        write_report(text + "\n\n" + call_table(rows))
    if not args.work:
        shutil.rmtree(work, ignore_errors=True)
    for line in campaign.memo_differences:
        print(f"memo changed a run: {line}", file=sys.stderr)
    failed = any(r.failures or r.mismatched for r in rows) or campaign.memo_differences
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
