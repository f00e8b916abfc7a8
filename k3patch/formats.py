"""The formats every layer shares, at the bottom of the house so that imports run one way: the
schema versions, the JSON envelope and report, the one-line verdicts of a log, the digests."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from k3patch.verdicts import summary as summary_verdict
from k3patch.version import VERSION

JSON_SCHEMA_VERSION = 1
STATE_SCHEMA_VERSION = 1


def patch_set_digest(patches_dir: str) -> str:
    """A hash of every .py file of the patch set (a patch is a module or a folder), by relative
    path and content: a state record made by other patch code is stale."""
    root = Path(patches_dir)
    names = sorted(p.relative_to(root).as_posix() for p in root.rglob("*.py"))
    digest = hashlib.sha256()
    for name in [n for n in names if "__pycache__" not in n.split("/")]:
        digest.update(name.encode() + b"\0" + (root / name).read_bytes())
    return digest.hexdigest()[:16]


def state_digest(
    version: str | None,
    hashes: Mapping[str, str | None],
    results: Iterable[Mapping[str, Any]],
    interrupted: str | None = None,
    state_unusable: bool = False,
) -> str:
    """One value two nodes can compare: vLLM version, every target file's hash, the verdicts,
    the op of a journal left by a killed run (its next apply rolls back: not the same state as
    a clean node's, though every file may be), and whether k3patch's own state is unusable (a
    node that cannot be reverted is not a clean node either)."""
    h = hashlib.sha256()
    h.update(f"vllm={version}\n".encode())
    if interrupted is not None:
        h.update(f"interrupted={interrupted}\n".encode())
    if state_unusable:
        h.update(b"state unusable\n")
    for rel, digest in sorted(hashes.items()):
        h.update(f"{rel}={digest}\n".encode())
    for r in sorted(results, key=lambda r: (r["patch"], r["site"], r["file"])):
        h.update(f"{r['patch']}|{r['site']}|{r['verdict']}\n".encode())
    return h.hexdigest()[:16]


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


def apply_fields(
    *,
    check: bool = False,
    refused_patches: Sequence[str] = (),
    all_or_nothing: bool = False,
    written: Sequence[str] = (),
    recovered: Sequence[str] = (),
    bytecode: Sequence[str] = (),
    bugs: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """What `apply --json` adds to the report (defaults: a run that had nothing to do)."""
    return {
        "bugs": dict(bugs or {}),
        "check": check,
        "refused": bool(refused_patches),
        "refused_patches": list(refused_patches),
        "all_or_nothing": all_or_nothing,
        "written": [f"vllm/{rel}" for rel in written],
        "recovered": list(recovered),
        "bytecode": list(bytecode),
    }


def envelope(command: str, exit_code: int, payload: Mapping[str, Any]) -> str:
    data = {
        "schema_version": JSON_SCHEMA_VERSION,
        "k3patch_version": VERSION,
        "command": command,
        "exit_code": exit_code,
        **payload,
    }
    return json.dumps(data, indent=2) + "\n"
