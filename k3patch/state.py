"""The state record beside the tree (`vllm/.k3patch/state.json`), and the journal next to it.

The record holds, per file k3patch changed, the hash of the original (kept as a blob, for an exact
revert) and of what k3patch wrote; and the last classification with the hashes of every target it
read, so that a run whose hashes all match reuses it without parsing (`fresh`: the no-op path and
the engine ask the same question). Verdicts never depend on it. Nothing in the record or journal
is trusted: each is "absent", "of another schema" or "damaged" until every field is checked, and
every path it names must be a registered target. This module imports no patch (the no-op path).
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any, NamedTuple

from k3patch import formats, safefs
from k3patch.errors import EnvironmentProblem
from k3patch.pycache import imported_instead, stale_bytecode
from k3patch.verdicts import SiteResult
from k3patch.version import VERSION

STATE_FILE = "state.json"
STATE_REL = f".k3patch/{STATE_FILE}"
SCHEMA = formats.STATE_SCHEMA_VERSION
_DIGEST = re.compile(r"^[0-9a-f]{64}$")


class RecordProblem(EnvironmentProblem):
    """The record or journal cannot be used as it is; nothing was written."""


class RecordDamaged(RecordProblem):
    kind = "damaged"


class RecordOtherSchema(RecordProblem):
    kind = "other schema"


def registered_targets() -> frozenset[str]:
    """Every file a patch of this k3patch may change: the only paths a record may name, and the
    files the no-op path hashes (never the record's own list)."""
    import k3patch.patches

    return frozenset(k3patch.patches.TARGETS)


@functools.cache
def patch_set() -> str:
    """The digest of the patch modules' source: a record made by other patch code is stale."""
    import k3patch.patches

    return formats.patch_set_digest(os.path.dirname(k3patch.patches.__file__ or ""))


def _hash_or_none(value: object) -> bool:
    return value is None or (isinstance(value, str) and _DIGEST.match(value) is not None)


def confined(rel: object, package_dir: Path | str, allowed: frozenset[str]) -> bool:
    """`rel` is a registered relative path that stays inside the package dir."""
    if not isinstance(rel, str) or rel not in allowed or not rel or rel.startswith("/"):
        return False
    parts = rel.split("/")
    if any(part in ("", ".", "..") for part in parts) or "\0" in rel or "\\" in rel:
        return False
    base = os.path.realpath(package_dir)
    return os.path.realpath(os.path.join(base, rel)).startswith(base + os.sep)


class FileState(NamedTuple):
    original: str | None  # sha256 of the file before k3patch first changed it (None: absent)
    applied: str | None  # sha256 of what k3patch last wrote
    patches: tuple[str, ...]

    def to_json(self) -> dict[str, Any]:
        return {"original": self.original, "applied": self.applied, "patches": list(self.patches)}


class StateRecord(NamedTuple):
    """The record as loaded (and checked) or about to be written. Like SiteResult, a NamedTuple:
    the no-op path loads it."""

    patch_set: str
    vllm_version: str | None
    patches: list[dict[str, str]]  # id, title, caveat of each
    files: dict[str, FileState]
    scan: dict[str, str | None]
    results: list[SiteResult]
    k3patch_version: str = VERSION

    @property
    def originals(self) -> set[str]:
        """The saved copies this record needs: the original of each file it names."""
        return {fs.original for fs in self.files.values() if fs.original}

    def to_bytes(self) -> bytes:
        data = {
            "schema_version": SCHEMA,
            "k3patch_version": self.k3patch_version,
            "patch_set": self.patch_set,
            "vllm_version": self.vllm_version,
            "patches": self.patches,
            "files": {rel: fs.to_json() for rel, fs in sorted(self.files.items())},
            "scan": dict(sorted(self.scan.items())),
            "results": [r.to_json() for r in self.results],
        }
        return (json.dumps(data, indent=1, sort_keys=False) + "\n").encode()


class _Bad(Exception):
    pass


def _need(ok: object, what: str) -> None:
    if not ok:
        raise _Bad(what)


def _checked(raw: dict[str, Any], package_dir: Path | str, allowed: frozenset[str]) -> StateRecord:
    """The record in `raw`, every field checked; _Bad says the first one that is wrong."""
    for key in ("k3patch_version", "patch_set"):
        _need(isinstance(raw.get(key), str), f"{key} is missing or not a string")
    _need(raw.get("vllm_version") is None or isinstance(raw["vllm_version"], str), "vllm_version")
    patches: Any = raw.get("patches")
    _need(isinstance(patches, list), "patches is not a list")
    for p in patches:
        keys = ("id", "title", "caveat")
        ok = isinstance(p, dict) and all(isinstance(p.get(k), str) for k in keys)
        _need(ok, "a patches entry lacks id, title or caveat")
    files_raw: Any = raw.get("files")
    _need(isinstance(files_raw, dict), "files is not an object")
    files = {}
    for rel, v in files_raw.items():
        _need(confined(rel, package_dir, allowed), f"files names {rel!r}, not a k3patch target")
        _need(isinstance(v, dict), f"files[{rel!r}] is not an object")
        for key in ("original", "applied"):
            _need(_hash_or_none(v.get(key)), f"files[{rel!r}].{key} is not a sha256")
        names = v.get("patches")
        _need(
            isinstance(names, list) and all(isinstance(n, str) for n in names),
            f"files[{rel!r}].patches",
        )
        files[rel] = FileState(v["original"], v["applied"], tuple(names))
    scan_raw: Any = raw.get("scan")
    _need(isinstance(scan_raw, dict), "scan is not an object")
    for rel, digest in scan_raw.items():
        _need(confined(rel, package_dir, allowed), f"scan names {rel!r}, not a k3patch target")
        _need(_hash_or_none(digest), f"scan[{rel!r}] is not a sha256")
    results_raw: Any = raw.get("results")
    _need(isinstance(results_raw, list), "results is not a list")
    results = []
    for r in results_raw:
        try:
            result = SiteResult.from_json(r)
        except (KeyError, TypeError, ValueError, AttributeError):
            raise _Bad("a results entry is malformed") from None
        fields = (result.patch_id, result.site, result.file)
        _need(all(isinstance(x, str) for x in fields), "a results entry is malformed")
        results.append(result)
    return StateRecord(
        k3patch_version=raw["k3patch_version"],
        patch_set=raw["patch_set"],
        vllm_version=raw.get("vllm_version"),
        patches=list(patches),
        files=files,
        scan=dict(scan_raw),
        results=results,
    )


def _json_object(data: bytes, where: str) -> dict[str, Any]:
    try:
        raw = json.loads(data)
    except (ValueError, RecursionError):
        raise damaged(where, "it is not valid JSON (truncated?)") from None
    if not isinstance(raw, dict):
        raise damaged(where, "it is not a JSON object")
    return raw


def damaged(where: str, why: str) -> RecordDamaged:
    return RecordDamaged(
        f"{where} is damaged: {why}. Nothing was written and its saved originals are kept. "
        "Restore the file from a backup, or reinstall vLLM (`pip install --force-reinstall "
        "--no-deps vllm==VERSION`) and then remove the .k3patch directory"
    )


def read_bytes(state_dir: Path) -> bytes | None:
    """The record's bytes, None when absent. A record that is not a regular file, or a
    `.k3patch` that is not a directory, is an environment problem, never "absent"."""
    return safefs.read_in(state_dir.parent, STATE_REL, what="state record")


def load(
    state_dir: Path, allowed: frozenset[str] | None = None, package_dir: Path | None = None
) -> StateRecord | None:
    """The record, checked field by field, or None when there is none. Raises RecordDamaged or
    RecordOtherSchema."""
    data = read_bytes(state_dir)
    if data is None:
        return None
    return parse(data, str(state_dir / STATE_FILE), package_dir or state_dir.parent, allowed)


def parse(
    data: bytes, where: str, package_dir: Path, allowed: frozenset[str] | None = None
) -> StateRecord:
    """The record in `data` (read from `where`), checked field by field."""
    raw = _json_object(data, where)
    if raw.get("schema_version") != SCHEMA:
        raise RecordOtherSchema(
            f"{where} has schema {raw.get('schema_version')!r}, this k3patch {VERSION} reads "
            f"schema {SCHEMA}; use the k3patch that wrote it (nothing was written, its saved "
            "originals are kept)"
        )
    allowed = registered_targets() if allowed is None else allowed
    try:
        return _checked(raw, package_dir, allowed)
    except _Bad as exc:
        raise damaged(where, str(exc)) from None


def load_or_none(state_dir: Path) -> StateRecord | None:
    """For readers that only want a cache (the fast path of scan): any problem is no record."""
    try:
        return load(state_dir)
    except EnvironmentProblem:
        return None


def fresh(record: StateRecord | None, hashes: Mapping[str, str | None]) -> bool:
    """The record still describes the tree: made by this k3patch and this patch code, from
    exactly these hashes of every registered target. Its classification then stands."""
    return (
        record is not None
        and record.k3patch_version == VERSION
        and record.patch_set == patch_set()
        and record.scan == dict(hashes)
    )


def fresh_record(package_dir: str) -> StateRecord | None:
    """The no-op path's (and the plugin's) question: the record of the tree at `package_dir`
    when it is fresh and no commit is in progress or interrupted; None on any doubt."""
    return check_record(package_dir)[0]


def saved_copy_names(package_dir: Path | str) -> list[str]:
    """The names of the saved copies in `.k3patch/blobs/` (blob-named regular files only). Here,
    not in `blobs`, so that the no-op path and the plugin list them without the write path's
    imports."""
    return safefs.regular_files(package_dir, ".k3patch/blobs", _DIGEST)


def planted_copy(package_dir: Path | str, present: set[str]) -> str | None:
    """Why `.k3patch/blobs/` holds an entry named like a saved copy that is not one of the
    regular files `present` (a link, FIFO or directory), or None: k3patch never follows, opens
    or removes it, so no revert could leave the tree without `.k3patch`."""
    names = safefs.entries(package_dir, ".k3patch/blobs", _DIGEST)
    if planted := sorted(set(names) - present):
        return (
            f"{Path(package_dir) / '.k3patch' / 'blobs' / planted[0]} is not a regular file, so "
            "not a saved copy k3patch made; k3patch never follows or removes it, and no revert "
            "could leave the tree clean: remove it"
        )
    return None


def missing_original(record: StateRecord, package_dir: Path | str) -> str | None:
    """Why `record` cannot be reverted for want of a saved original it names (gone, or not a
    regular file), or for an entry planted among them (planted_copy), or None. A listing only:
    revert checks each copy's bytes."""
    present = set(saved_copy_names(package_dir))
    if planted := planted_copy(package_dir, present):
        return planted
    for rel, fs in sorted(record.files.items()):
        if fs.original is not None and fs.original not in present:
            return (
                f"the saved original of vllm/{rel} ({fs.original[:12]}) is missing from "
                f"{Path(package_dir) / '.k3patch' / 'blobs'}, so no revert can restore that file; "
                "reinstall vLLM to get the original files back"
            )
    return None


def check_record(package_dir: str) -> tuple[StateRecord | None, str, str]:
    """fresh_record's answer with its reason: (the fresh record, "fresh", "") or (None, kind,
    why), kind one of "journal" (a commit in progress or interrupted), "absent", "damaged",
    "other schema", "unreadable" (not a regular file, or this user may not read it: never
    "absent"), "target unreadable", "stale" (a target's hash, the k3patch or the patch code
    differs)."""
    state_dir = Path(package_dir) / ".k3patch"
    try:
        if safefs.read_in(package_dir, JOURNAL_REL, what="journal") is not None:
            why = f"a k3patch journal is in {state_dir} (a run in progress or killed)"
            return None, "journal", why
        record = load(state_dir, registered_targets(), Path(package_dir))
    except EnvironmentProblem as exc:  # RecordDamaged and RecordOtherSchema say their kind
        return None, getattr(exc, "kind", "unreadable"), str(exc)
    if record is None:
        return None, "absent", f"no state record in {state_dir}"
    if gone := missing_original(record, package_dir):
        return None, "damaged", gone
    try:
        data = {
            rel: safefs.read_file(os.path.join(package_dir, rel))
            for rel in sorted(registered_targets())
        }
    except safefs.NotRegular as exc:
        return None, "target unreadable", f"a target file is not a regular file ({exc.kind})"
    except OSError as exc:
        return None, "target unreadable", f"cannot read a target: {exc.strerror or exc}"
    hashes = {rel: None if d is None else hashlib.sha256(d).hexdigest() for rel, d in data.items()}
    if not fresh(record, hashes):
        return None, "stale", "the files differ from the record"
    for rel, d in data.items():
        pyc = stale_bytecode(Path(package_dir) / rel, d) or imported_instead(
            Path(package_dir) / rel
        )
        if pyc is not None:
            return None, "stale bytecode", f"Python runs {pyc}, not the code of vllm/{rel}"
    return record, "fresh", ""


# The journal of a commit in progress: what to roll back when the run that wrote it died.
JOURNAL_REL = ".k3patch/journal.json"


def journal_data(op: str, files: list[dict[str, Any]], pid: int, when: float) -> bytes:
    """A journal: the op, who wrote it and when, and each file's path, before and after hash."""
    return json.dumps({"op": op, "pid": pid, "time": when, "files": files}, indent=1).encode()


def load_journal(package_dir: Path, allowed: frozenset[str]) -> dict[str, Any] | None:
    """The journal of an interrupted (or running) commit, checked entry by entry; None when there
    is none. A journal that names anything but a path in `allowed` is damaged (RecordDamaged)."""
    data = safefs.read_in(package_dir, JOURNAL_REL, what="journal")
    if data is None:
        return None
    where = str(package_dir / JOURNAL_REL)
    loaded = _json_object(data, where)
    files = loaded.get("files")
    if not isinstance(files, list) or not isinstance(loaded.get("op"), str):
        raise damaged(where, "it lacks op or files")
    for entry in files:
        if not isinstance(entry, dict) or not confined(entry.get("path"), package_dir, allowed):
            raise damaged(where, f"it names {entry!r}, not a k3patch target")
        for key in ("before", "after"):
            if not _hash_or_none(entry.get(key)):
                raise damaged(where, f"{key} of {entry.get('path')!r} is not a sha256")
            # k3patch creates and removes only its own record: a vLLM file "absent" before or
            # after is a forged entry, whose recovery would delete that file.
            if entry.get(key) is None and entry["path"] != STATE_REL:
                raise damaged(where, f"{key} of {entry['path']!r} is absent: not a k3patch edit")
    return {"op": loaded["op"], "files": files}
