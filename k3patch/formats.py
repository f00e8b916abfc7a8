"""The formats every layer shares, kept at the bottom of the house so that imports run one way:
the schema versions of the state record and of the JSON output, the JSON envelope and report,
the digests two nodes compare, the hash of the patch set and the targets it registers (read from
the patch sources' text, without importing them), and the no-follow hash of a target file.
Standard library only: the no-op path, the engine and the CLI all import it.
"""

from __future__ import annotations

import os
import stat

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing (start-up cost)

if TYPE_CHECKING:
    from collections.abc import Iterable, Mapping, Sequence
    from typing import Any

JSON_SCHEMA_VERSION = 1
STATE_SCHEMA_VERSION = 1
_GOOD = ("applied", "satisfied", "not applicable")


def sha256(data: bytes = b"") -> Any:
    """A sha256 hasher. The interpreter's built-in one where it has it: `hashlib` loads OpenSSL
    first (2-3 ms of start-up), and every rank's entrypoint hashes a handful of small files."""
    try:
        from _sha2 import sha256 as builtin  # type: ignore[import-not-found]  # 3.12 and later
    except ImportError:
        try:
            from _sha256 import sha256 as builtin  # type: ignore[import-not-found,no-redef]
        except ImportError:
            from hashlib import sha256 as builtin  # type: ignore[assignment]
    return builtin(data)


class NotPlainFile(OSError):
    """A target that is a symlink, FIFO, device or directory: never opened for reading."""


def file_sha256(path: str) -> str | None:
    """The sha256 of a regular file, None when absent. Never follows a symlink and never
    blocks on a FIFO (opened non-blocking, refused by fstat before any read)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise NotPlainFile(exc.errno, exc.strerror, path) from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise NotPlainFile(0, "not a regular file", path)
        digest = sha256()
        while chunk := os.read(fd, 1 << 20):
            digest.update(chunk)
        return digest.hexdigest()
    finally:
        os.close(fd)


def patch_set_digest(patches_dir: str) -> str:
    """A hash of the patch modules' source: a record made by other patch code is stale."""
    return _patch_set(patches_dir)[0]


_PATTERNS: list[Any] = []


def _patterns() -> list[Any]:
    """The constant-expression patterns, compiled on first use (`re` is not free at start-up)."""
    if not _PATTERNS:
        import re

        _PATTERNS[:] = [
            re.compile(r"[A-Z][A-Z0-9_]*"),
            re.compile(r"\(\s*([A-Z][A-Z0-9_]*\s*(?:,\s*[A-Z][A-Z0-9_]*\s*)*),?\s*\)"),
            re.compile(r'(f?)"([^"\\{}]*(?:\{[A-Z][A-Z0-9_]*\}[^"\\{}]*)*)"'),
            re.compile(r"\{([A-Z][A-Z0-9_]*)\}"),
        ]
    return _PATTERNS


def _assigned(text: str, name: str, indent: str = "") -> str | None:
    """The right-hand side of the one line `name = ...` at this indent, found with str.find
    (a regex over 200 kB of patch source would cost the no-op path milliseconds)."""
    key = f"\n{indent}{name} = "
    start = text.find(key)
    if start < 0 or text.find(key, start + 1) >= 0:
        return None
    end = text.find("\n", start + len(key))
    return text[start + len(key) : end if end >= 0 else len(text)].split("  #")[0].strip()


def _resolve(text: str, expr: str, depth: int = 0) -> list[str] | None:
    """A constant expression of plain string constants (f-strings of constants too) and
    tuples of them, resolved to its strings; None for anything else."""
    if depth > 4:
        return None
    name_re, tuple_re, string_re, ref_re = _patterns()
    string = string_re.fullmatch(expr)
    if string:
        value = string.group(2)
        if string.group(1):
            parts = {}
            for ref in set(ref_re.findall(value)):
                got = _resolve(text, _assigned(text, ref) or "", depth + 1)
                if got is None or len(got) != 1:
                    return None
                parts[ref] = got[0]
            value = ref_re.sub(lambda m: parts[m.group(1)], value)
        return [value]
    names = tuple_re.fullmatch(expr)
    if names:
        out: list[str] = []
        for name in names.group(1).split(","):
            got = _resolve(text, name.strip(), depth + 1)
            if got is None:
                return None
            out += got
        return out
    if name_re.fullmatch(expr):
        return _resolve(text, _assigned(text, expr) or "", depth + 1)
    return None


def _declared_files(text: str) -> list[str] | None:
    """The `files` a patch module declares, read from its text without importing it (the no-op
    path must stay cheap). None when they are not written as plain module constants: then the
    fast path declines and the full path, which imports the registry, decides."""
    spec = _assigned(text, "files", "    ")
    return None if spec is None else _resolve(text, spec)


def _patch_sources(patches_dir: str) -> list[str]:
    """Every .py file of the patch set (a patch is a module or a folder), relative, sorted."""
    found = []
    for folder, dirs, files in os.walk(patches_dir):
        dirs[:] = sorted(d for d in dirs if d != "__pycache__")
        rel = os.path.relpath(folder, patches_dir)
        found += [n if rel == "." else f"{rel}/{n}" for n in files if n.endswith(".py")]
    return sorted(found)


def _patch_set(patches_dir: str) -> tuple[str, frozenset[str] | None]:
    """The patch-set digest and the registered target files, from one read of the modules."""
    digest = sha256()
    targets: set[str] | None = set()
    for name in _patch_sources(patches_dir):
        if name != "__init__.py":
            digest.update(name.encode() + b"\0")
            with open(os.path.join(patches_dir, name), "rb") as handle:
                data = handle.read()
            digest.update(data)
            if targets is not None and b"\nPATCH = " in data:
                files = _declared_files(data.decode("utf-8", "replace"))
                targets = None if files is None else targets | set(files)
    return digest.hexdigest()[:16], None if targets is None else frozenset(targets)


def state_digest(
    version: str | None, hashes: Mapping[str, str | None], results: Iterable[Mapping[str, Any]]
) -> str:
    """One value two nodes can compare: vLLM version, every target file's hash, the verdicts."""
    h = sha256()
    h.update(f"vllm={version}\n".encode())
    for rel, digest in sorted(hashes.items()):
        h.update(f"{rel}={digest}\n".encode())
    for r in sorted(results, key=lambda r: (r["patch"], r["site"], r["file"])):
        h.update(f"{r['patch']}|{r['site']}|{r['verdict']}\n".encode())
    return h.hexdigest()[:16]


def summary_verdict(verdicts: Iterable[str]) -> str:
    seen = set(verdicts)
    for verdict in ("drifted", "pending", "applied", "satisfied", "not applicable"):
        if verdict in seen:
            return verdict
    return "not applicable"


def quiet_line(patch_id: str, results: Sequence[Mapping[str, Any]]) -> str:
    """One line per patch; a drifted one also names the file, the site and what was wrong."""
    mine = [r for r in results if r["patch"] == patch_id]
    verdict = summary_verdict(r["verdict"] for r in mine)
    line = f"{patch_id}: {verdict}"
    if verdict == "drifted":
        first = next(r for r in mine if r["verdict"] == "drifted")
        line += f": vllm/{first['file']}: {first['site']}: {first['detail']}"
    return line


def report_json(
    vllm: Mapping[str, Any],
    digest: str,
    from_record: bool,
    interrupted: str | None,
    patches: Sequence[Mapping[str, str]],
    results: Sequence[Mapping[str, Any]],
) -> dict[str, Any]:
    return {
        "vllm": dict(vllm),
        "digest": digest,
        "from_record": from_record,
        "interrupted": interrupted,
        "patches": [
            {
                "id": p["id"],
                "title": p["title"],
                "verdict": summary_verdict(r["verdict"] for r in results if r["patch"] == p["id"]),
                "caveat": p["caveat"],
                "sites": [dict(r) for r in results if r["patch"] == p["id"]],
            }
            for p in patches
        ],
    }


def envelope(command: str, exit_code: int, payload: Mapping[str, Any]) -> str:
    import json

    from k3patch import __version__

    data = {
        "schema_version": JSON_SCHEMA_VERSION,
        "k3patch_version": __version__,
        "command": command,
        "exit_code": exit_code,
        **payload,
    }
    return json.dumps(data, indent=2) + "\n"
