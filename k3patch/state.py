"""The state record beside the tree (`vllm/.k3patch/state.json`), and the journal next to it.

The record holds, per file k3patch changed, the hash of the original (whose bytes are kept as a
blob, for an exact revert) and of what k3patch wrote; and the classification of the last run with
the hashes of every target file it read, so that a later run whose hashes all match can reuse it
without parsing anything (`fresh`: the entrypoint's no-op path and the engine ask the same
question here). It is a cache plus revert data: verdicts never depend on it, only on the code.
The journal names the files a commit in progress replaces, with their before and after hashes.

Nothing in either is trusted: a record copied from another tree, truncated, written by another
k3patch or edited by hand must never make k3patch write outside the tree, delete a saved original,
or report a state the code is not in. So a record is "absent", "of another schema" or "damaged"
(each its own error) until every field has been checked, and every path it or a journal names
must be one of the registered targets (`k3patch.patches.TARGETS`, which the registry holds every
patch's `files` to). This module imports no patch: the no-op path loads it.
"""

from __future__ import annotations

import functools
import json
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from k3patch import __version__, formats, safefs
from k3patch.errors import EnvironmentProblem
from k3patch.verdicts import SiteResult

STATE_FILE = "state.json"
STATE_REL = f".k3patch/{STATE_FILE}"
SCHEMA = formats.STATE_SCHEMA_VERSION
_DIGEST = re.compile(r"^[0-9a-f]{64}$")


class RecordProblem(EnvironmentProblem):
    """The record or journal cannot be used as it is; nothing was written."""


class RecordDamaged(RecordProblem):
    pass


class RecordOtherSchema(RecordProblem):
    pass


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


def is_digest(value: object) -> bool:
    return isinstance(value, str) and _DIGEST.match(value) is not None


def confined(rel: object, package_dir: Path | str, allowed: frozenset[str]) -> bool:
    """`rel` is a registered relative path that stays inside the package dir."""
    if not isinstance(rel, str) or rel not in allowed or not rel or rel.startswith("/"):
        return False
    parts = rel.split("/")
    if any(part in ("", ".", "..") for part in parts) or "\0" in rel or "\\" in rel:
        return False
    base = os.path.realpath(package_dir)
    return os.path.realpath(os.path.join(base, rel)).startswith(base + os.sep)


@dataclass(frozen=True)
class FileState:
    original: str | None  # sha256 of the file before k3patch first changed it (None: absent)
    applied: str | None  # sha256 of what k3patch last wrote
    patches: tuple[str, ...]

    def to_json(self) -> dict[str, Any]:
        return {"original": self.original, "applied": self.applied, "patches": list(self.patches)}


@dataclass
class StateRecord:
    k3patch_version: str = __version__
    patch_set: str = ""
    vllm_version: str | None = None
    patches: list[dict[str, str]] = field(default_factory=list)  # id, title, caveat of each
    files: dict[str, FileState] = field(default_factory=dict)
    scan: dict[str, str | None] = field(default_factory=dict)
    results: list[SiteResult] = field(default_factory=list)

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

    @classmethod
    def from_bytes(
        cls, data: bytes, package_dir: Path | str, allowed: frozenset[str], where: str = ""
    ) -> StateRecord:
        """The record, checked field by field. Raises RecordOtherSchema or RecordDamaged."""
        where = where or STATE_REL
        try:
            raw = json.loads(data)
        except (ValueError, RecursionError):
            raise damaged(where, "it is not valid JSON (truncated?)") from None
        if not isinstance(raw, dict):
            raise damaged(where, "it is not a JSON object")
        schema = raw.get("schema_version")
        if schema != SCHEMA:
            raise RecordOtherSchema(
                f"{where} has schema {schema!r}, this k3patch {__version__} reads schema "
                f"{SCHEMA}; use the k3patch that wrote it (nothing was written, its saved "
                "originals are kept)"
            )
        try:
            return cls._checked(raw, package_dir, allowed)
        except _Bad as exc:
            raise damaged(where, str(exc)) from None

    @classmethod
    def _checked(
        cls, raw: dict[str, Any], package_dir: Path | str, allowed: frozenset[str]
    ) -> StateRecord:
        def need(ok: bool, what: str) -> None:
            if not ok:
                raise _Bad(what)

        for key in ("k3patch_version", "patch_set"):
            need(isinstance(raw.get(key), str), f"{key} is missing or not a string")
        need(
            raw.get("vllm_version") is None or isinstance(raw["vllm_version"], str), "vllm_version"
        )
        patches: Any = raw.get("patches")
        need(isinstance(patches, list), "patches is not a list")
        for p in patches:
            need(
                isinstance(p, dict)
                and all(isinstance(p.get(k), str) for k in ("id", "title", "caveat")),
                "a patches entry lacks id, title or caveat",
            )
        files_raw: Any = raw.get("files")
        need(isinstance(files_raw, dict), "files is not an object")
        files = {}
        for rel, v in files_raw.items():
            need(confined(rel, package_dir, allowed), f"files names {rel!r}, not a k3patch target")
            need(isinstance(v, dict), f"files[{rel!r}] is not an object")
            for key in ("original", "applied"):
                need(
                    v.get(key) is None or is_digest(v.get(key)),
                    f"files[{rel!r}].{key} is not a sha256",
                )
            names = v.get("patches")
            need(
                isinstance(names, list) and all(isinstance(n, str) for n in names),
                f"files[{rel!r}].patches",
            )
            files[rel] = FileState(v["original"], v["applied"], tuple(names))
        scan_raw: Any = raw.get("scan")
        need(isinstance(scan_raw, dict), "scan is not an object")
        for rel, digest in scan_raw.items():
            need(confined(rel, package_dir, allowed), f"scan names {rel!r}, not a k3patch target")
            need(digest is None or is_digest(digest), f"scan[{rel!r}] is not a sha256")
        results_raw: Any = raw.get("results")
        need(isinstance(results_raw, list), "results is not a list")
        results = []
        for r in results_raw:
            try:
                result = SiteResult.from_json(r)
            except (KeyError, TypeError, ValueError, AttributeError):
                raise _Bad("a results entry is malformed") from None
            need(
                all(isinstance(x, str) for x in (result.patch_id, result.site, result.file)),
                "a results entry is malformed",
            )
            results.append(result)
        return cls(
            k3patch_version=raw["k3patch_version"],
            patch_set=raw["patch_set"],
            vllm_version=raw.get("vllm_version"),
            patches=list(patches),
            files=files,
            scan=dict(scan_raw),
            results=results,
        )


class _Bad(Exception):
    pass


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
    """The record, or None when there is none. Raises RecordDamaged / RecordOtherSchema."""
    data = read_bytes(state_dir)
    if data is None:
        return None
    return StateRecord.from_bytes(
        data,
        package_dir or state_dir.parent,
        registered_targets() if allowed is None else allowed,
        str(state_dir / STATE_FILE),
    )


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
        and record.k3patch_version == __version__
        and record.patch_set == patch_set()
        and record.scan == dict(hashes)
    )


def fresh_record(package_dir: str) -> StateRecord | None:
    """The no-op path's (and the plugin's) question: the record of the tree at `package_dir`
    when it is fresh and no commit is in progress or interrupted; None on any doubt (the full
    path then looks at the code itself). Every target is hashed with the one no-follow reader."""
    return check_record(package_dir)[0]


def check_record(package_dir: str) -> tuple[StateRecord | None, str, str]:
    """fresh_record's answer with its reason: (the fresh record, "fresh", "") or (None, kind,
    why), kind one of "journal" (a commit in progress or interrupted), "absent", "damaged",
    "other schema", "unreadable" (not a regular file, or this user may not read it: never
    "absent"), "target unreadable", "stale" (a target's hash, the k3patch or the patch code
    differs)."""
    state_dir = Path(package_dir) / ".k3patch"
    try:
        journal = journal_bytes(Path(package_dir))
    except EnvironmentProblem as exc:
        return None, "unreadable", str(exc)
    if journal is not None:
        return None, "journal", f"a k3patch journal is in {state_dir} (a run in progress or killed)"
    try:
        record = load(state_dir, registered_targets(), Path(package_dir))
    except RecordOtherSchema as exc:
        return None, "other schema", str(exc)
    except RecordDamaged as exc:
        return None, "damaged", str(exc)
    except EnvironmentProblem as exc:
        return None, "unreadable", str(exc)
    if record is None:
        return None, "absent", f"no state record in {state_dir}"
    try:
        hashes = {
            rel: safefs.file_sha256(os.path.join(package_dir, rel))
            for rel in sorted(registered_targets())
        }
    except safefs.NotRegular as exc:
        return None, "target unreadable", f"a target file is not a regular file ({exc.kind})"
    except OSError as exc:
        return None, "target unreadable", f"cannot read a target: {exc.strerror or exc}"
    if not fresh(record, hashes):
        return None, "stale", "the files differ from the record"
    return record, "fresh", ""


# ------------------------------------------------------------------------------------------
# The journal of a commit in progress.

JOURNAL = "journal.json"
JOURNAL_REL = f".k3patch/{JOURNAL}"


def journal_data(op: str, files: list[dict[str, Any]], pid: int, when: float) -> bytes:
    """A journal: the op, who wrote it and when, and each file's path, before and after hash."""
    journal = {"op": op, "pid": pid, "time": when, "files": files}
    return json.dumps(journal, indent=1).encode()


def journal_bytes(package_dir: Path) -> bytes | None:
    return safefs.read_in(package_dir, JOURNAL_REL, what="journal")


def load_journal(package_dir: Path, allowed: frozenset[str]) -> dict[str, Any] | None:
    """The journal of an interrupted (or running) commit, checked entry by entry; None when there
    is none. A journal that names anything but a path in `allowed` is damaged (RecordDamaged)."""
    data = journal_bytes(package_dir)
    if data is None:
        return None
    where = str(package_dir / JOURNAL_REL)
    try:
        loaded = json.loads(data)
    except (ValueError, RecursionError):
        raise damaged(where, "it is not valid JSON (truncated?)") from None
    files = loaded.get("files") if isinstance(loaded, dict) else None
    if not isinstance(files, list) or not isinstance(loaded.get("op"), str):
        raise damaged(where, "it lacks op or files")
    for entry in files:
        if not isinstance(entry, dict) or not confined(entry.get("path"), package_dir, allowed):
            raise damaged(where, f"it names {entry!r}, not a k3patch target")
        for key in ("before", "after"):
            value = entry.get(key)
            if value is not None and not is_digest(value):
                raise damaged(where, f"{key} of {entry.get('path')!r} is not a sha256")
    return {"op": loaded["op"], "files": files}
