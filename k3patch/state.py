"""The state record beside the tree (`vllm/.k3patch/state.json`).

It holds, per file k3patch changed, the hash of the original (whose bytes are kept as a blob,
for an exact revert) and of what k3patch wrote; and the classification of the last run with the
hashes of every target file it read, so that a later run whose hashes all match can reuse it
without parsing anything (the entrypoint's no-op path). It is a cache plus revert data: verdicts
never depend on it, only on the code itself.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from k3patch import __version__, fastpath
from k3patch.model import SiteResult

STATE_FILE = "state.json"
STATE_REL = f".k3patch/{STATE_FILE}"
SCHEMA = fastpath.STATE_SCHEMA_VERSION


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
    def from_bytes(cls, data: bytes) -> StateRecord | None:
        """The record, or None when it is unreadable or of another schema (then it is ignored
        for the fast path; revert refuses without a readable record)."""
        try:
            raw = json.loads(data)
            if raw.get("schema_version") != SCHEMA:
                return None
            return cls(
                k3patch_version=raw["k3patch_version"],
                patch_set=raw["patch_set"],
                vllm_version=raw.get("vllm_version"),
                patches=list(raw["patches"]),
                files={
                    rel: FileState(v["original"], v["applied"], tuple(v["patches"]))
                    for rel, v in raw["files"].items()
                },
                scan=dict(raw["scan"]),
                results=[SiteResult.from_json(r) for r in raw["results"]],
            )
        except (ValueError, KeyError, TypeError, AttributeError):
            return None


def load(state_dir: Path) -> StateRecord | None:
    try:
        data = (state_dir / STATE_FILE).read_bytes()
    except (FileNotFoundError, NotADirectoryError):
        return None
    return StateRecord.from_bytes(data)
