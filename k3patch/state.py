"""The state record beside the tree (`vllm/.k3patch/state.json`).

It holds, per file k3patch changed, the hash of the original (whose bytes are kept as a blob,
for an exact revert) and of what k3patch wrote; and the classification of the last run with the
hashes of every target file it read, so that a later run whose hashes all match can reuse it
without parsing anything (the entrypoint's no-op path). It is a cache plus revert data: verdicts
never depend on it, only on the code itself.

Nothing in it is trusted: a record copied from another tree, truncated, written by another k3patch
or edited by hand must never make k3patch write outside the tree, delete a saved original, or
report a state the code is not in. So a record is "absent", "of another schema" or "damaged"
(each its own error) until every field has been checked, and every path it names must be one of
the registry's targets.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from k3patch import __version__, formats
from k3patch.lock import EnvironmentProblem
from k3patch.model import SiteResult

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
    """Every file a patch of this k3patch may change: the only paths a record may name."""
    from k3patch.registry import all_patches

    return frozenset(rel for patch in all_patches() for rel in patch.files)


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
            raise _damaged(where, "it is not valid JSON (truncated?)") from None
        if not isinstance(raw, dict):
            raise _damaged(where, "it is not a JSON object")
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
            raise _damaged(where, str(exc)) from None

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


def _damaged(where: str, why: str) -> RecordDamaged:
    return RecordDamaged(
        f"{where} is damaged: {why}. Nothing was written and its saved originals are kept. "
        "Restore the file from a backup, or reinstall vLLM (`pip install --force-reinstall "
        "--no-deps vllm==VERSION`) and then remove the .k3patch directory"
    )


def read_bytes(state_dir: Path) -> bytes | None:
    """The record's bytes, None when absent. A record that is not a regular file, or a
    `.k3patch` that is not a directory, is an environment problem, never "absent"."""
    from k3patch.safefs import read_regular

    return read_regular(state_dir / STATE_FILE, what="state record")


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
