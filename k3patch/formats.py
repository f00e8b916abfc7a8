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
    from collections.abc import Iterable, Iterator, Mapping, Sequence
    from typing import Any

JSON_SCHEMA_VERSION = 1
STATE_SCHEMA_VERSION = 1
_GOOD = ("applied", "satisfied", "not applicable")


_SHA256: list[Any] = []  # the constructor, found on first use


def sha256(data: bytes = b"") -> Any:
    """A sha256 hasher. The interpreter's built-in one where it has it: `hashlib` loads OpenSSL
    first (2-3 ms of start-up), and every rank's entrypoint hashes a handful of small files.
    Looked up once: a failed import is not cached and would search sys.path on every call."""
    if not _SHA256:
        try:
            from _sha2 import sha256 as builtin  # type: ignore[import-not-found]  # 3.12 and later
        except ImportError:
            try:
                from _sha256 import sha256 as builtin  # type: ignore[import-not-found,no-redef]
            except ImportError:
                from hashlib import sha256 as builtin  # type: ignore[assignment]
        _SHA256.append(builtin)
    return _SHA256[0](data)


class _ScanContext:
    """What the interpreter's C JSON scanner reads from a decoder (json.decoder.JSONDecoder's
    defaults), except that NaN and Infinity, which k3patch never writes, are refused."""

    strict = True
    object_hook = None
    object_pairs_hook = None
    parse_float = float
    parse_int = int

    @staticmethod
    def parse_constant(name: str) -> Any:
        raise ValueError(f"{name} is not a value k3patch writes")


def load_json(data: bytes) -> Any:
    """`json.loads` of a state record, through the interpreter's C scanner (`_json`, which the
    `json` package itself uses) where there is one: importing `json` imports `re` and `enum`,
    5-11 ms of start-up on the operators' Python 3.12, on the path every rank's entrypoint
    takes. Anything that is not one JSON value raises ValueError (or RecursionError)."""
    text = data.decode("utf-8")
    try:
        from _json import make_scanner
    except ImportError:
        import json

        return json.loads(text)
    whitespace = " \t\n\r"
    start = len(text) - len(text.lstrip(whitespace))
    try:
        value, end = make_scanner(_ScanContext())(text, start)  # type: ignore[arg-type]
    except StopIteration as exc:
        raise ValueError(f"not JSON at character {exc.value}") from None
    if text[end:].strip(whitespace):
        raise ValueError(f"extra data after the JSON value at character {end}")
    return value


def dump_json(data: Any) -> str:
    """`json.dumps(data, indent=2)`, byte for byte, without importing `json` (see load_json):
    the `--json` output of the no-op path, which a Slurm preflight asks every node for. Strings
    go through the same C escaper `json` uses; anything this does not know goes to `json`."""
    quote: Any
    try:
        from _json import encode_basestring_ascii as quote
    except ImportError:
        quote = None
    if quote is not None:
        try:
            return "".join(_encode(data, quote, "\n"))
        except (TypeError, RecursionError):
            pass  # a type JSON has no plain form for, or a cycle: let `json` say it
    import json

    return json.dumps(data, indent=2)


def _encode(value: Any, quote: Any, newline: str) -> Iterator[str]:
    if isinstance(value, str):
        yield quote(value)
    elif value is None or value is True or value is False:
        yield {None: "null", True: "true", False: "false"}[value]
    elif isinstance(value, int | float):
        yield _number(value)
    elif isinstance(value, list | tuple):
        if not value:
            yield "[]"
            return
        inner = newline + "  "
        yield "["
        for i, item in enumerate(value):
            yield inner if i == 0 else "," + inner
            yield from _encode(item, quote, inner)
        yield newline + "]"
    elif isinstance(value, dict):
        if not value:
            yield "{}"
            return
        inner = newline + "  "
        yield "{"
        for i, (key, item) in enumerate(value.items()):
            if not isinstance(key, str):
                raise TypeError("a key JSON would convert")
            yield (inner if i == 0 else "," + inner) + quote(key) + ": "
            yield from _encode(item, quote, inner)
        yield newline + "}"
    else:
        raise TypeError(type(value).__name__)


def _number(value: int | float) -> str:
    if isinstance(value, int):
        return int.__repr__(value)
    if value != value:
        return "NaN"
    if value in (float("inf"), float("-inf")):
        return "Infinity" if value > 0 else "-Infinity"
    return float.__repr__(value)


class NotPlainFile(OSError):
    """A target that is a symlink, FIFO, device or directory: never opened for reading."""


def _open_plain(path: str) -> int:
    """A read-only fd of the regular file at `path`. Never follows a symlink and never blocks
    on a FIFO (opened non-blocking, refused by fstat before any read)."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise NotPlainFile(0, "not a regular file", path)
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_plain(path: str, limit: int = 16 << 20) -> bytes:
    """At most `limit` bytes of the regular file at `path` (see _open_plain)."""
    fd = _open_plain(path)
    try:
        return os.read(fd, limit)
    finally:
        os.close(fd)


def file_sha256(path: str) -> str | None:
    """The sha256 of a regular file, None when absent (see _open_plain)."""
    try:
        fd = _open_plain(path)
    except FileNotFoundError:
        return None
    except NotPlainFile:
        raise
    except OSError as exc:
        raise NotPlainFile(exc.errno, exc.strerror, path) from None
    try:
        digest = sha256()
        while chunk := os.read(fd, 1 << 20):
            digest.update(chunk)
        return digest.hexdigest()
    finally:
        os.close(fd)


def patch_set_digest(patches_dir: str) -> str:
    """A hash of the patch modules' source: a record made by other patch code is stale."""
    return _patch_set(patches_dir)[0]


_UPPER = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"
_NAME_CHARS = frozenset(_UPPER + "0123456789_")

# The declarations below are read with str methods, not `re`: `re` imports `enum`, 3-6 ms of
# start-up on the no-op path, which every rank's entrypoint takes.


def _is_name(text: str) -> bool:
    """A module constant's name: [A-Z][A-Z0-9_]*."""
    return text != "" and text[0] in _UPPER and all(c in _NAME_CHARS for c in text)


def _tuple_names(expr: str) -> list[str] | None:
    """`(NAME, NAME, ...)` with an optional trailing comma: the names; else None."""
    if not (expr.startswith("(") and expr.endswith(")")):
        return None
    items = expr[1:-1].split(",")
    if not items[-1].strip():
        items.pop()
    names = [item.strip() for item in items]
    return names if all(_is_name(n) for n in names) else None


def _string(expr: str) -> tuple[bool, str, list[str]] | None:
    """`"..."` or `f"..."` without quotes or backslashes inside and braces only around a
    constant's name: (is an f-string, the text between the quotes, the names in braces)."""
    is_f = expr.startswith("f")
    quoted = expr[1:] if is_f else expr
    if len(quoted) < 2 or quoted[0] != '"' or quoted[-1] != '"':
        return None
    body = quoted[1:-1]
    if '"' in body or "\\" in body:
        return None
    refs, rest = [], body
    while rest:
        opening, closing = rest.find("{"), rest.find("}")
        if opening < 0:
            if closing >= 0:
                return None
            break
        if not _is_name(rest[opening + 1 : closing]):  # also a "}" before the "{"
            return None
        refs.append(rest[opening + 1 : closing])
        rest = rest[closing + 1 :]
    return is_f, body, refs


def _substitute(body: str, values: dict[str, str]) -> str:
    """Every `{NAME}` of a checked f-string body replaced by its value, in one pass."""
    out, rest = [], body
    while (opening := rest.find("{")) >= 0:
        closing = rest.find("}", opening)
        out += [rest[:opening], values[rest[opening + 1 : closing]]]
        rest = rest[closing + 1 :]
    return "".join([*out, rest])


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
    string = _string(expr)
    if string:
        is_f, value, refs = string
        if is_f:
            parts = {}
            for ref in set(refs):
                got = _resolve(text, _assigned(text, ref) or "", depth + 1)
                if got is None or len(got) != 1:
                    return None
                parts[ref] = got[0]
            value = _substitute(value, parts)
        return [value]
    names = _tuple_names(expr)
    if names:
        out: list[str] = []
        for name in names:
            got = _resolve(text, name, depth + 1)
            if got is None:
                return None
            out += got
        return out
    if _is_name(expr):
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
    from k3patch import __version__

    data = {
        "schema_version": JSON_SCHEMA_VERSION,
        "k3patch_version": __version__,
        "command": command,
        "exit_code": exit_code,
        **payload,
    }
    return dump_json(data) + "\n"
