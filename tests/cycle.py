"""The full cycle every patch goes through on a real tree, written once: pending, `--check`
writes nothing, apply writes exactly the patch's files, applied, a second apply changes no
byte, and revert puts back every byte. Each patch's tests call `assert_full_cycle` on its own
trees and add what is particular to that patch (shapes, kept statements) on the statuses it
returns or in `while_applied`."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from conftest import run_cli, status_json, tree_hashes

STATE_DIR = "vllm/.k3patch"


@dataclass(frozen=True)
class Cycle:
    pending: dict  # `status --json --only ID` before the apply (exit code under "_rc")
    applied: dict  # the same after the first apply


def changed_sources(before: dict[str, str], after: dict[str, str]) -> set[str]:
    """The files (outside k3patch's state dir) that appeared, vanished or changed."""
    return {
        rel
        for rel in before.keys() | after.keys()
        if before.get(rel) != after.get(rel) and not rel.startswith(STATE_DIR)
    }


def assert_full_cycle(
    site: Path,
    patch_id: str,
    *,
    written: Iterable[str],
    while_applied: Callable[[dict], None] | None = None,
) -> Cycle:
    """Run the cycle of `patch_id` on the pending tree `site` through the CLI, as a user would.
    `written`: the files (relative to `site`, "vllm/...") the apply must change, and no other.
    `while_applied(status)` runs on the patched tree, before the second apply."""
    only = ("--only", patch_id)
    original = tree_hashes(site)

    pending = status_json(site, *only)
    assert pending["_rc"] == 1, pending
    assert [p["id"] for p in pending["patches"]] == [patch_id], pending
    assert pending["patches"][0]["verdict"] == "pending", pending["patches"][0]

    check = run_cli("apply", "--vllm", str(site), "--check", *only)
    assert check.returncode == 1, check.stdout + check.stderr
    assert tree_hashes(site) == original, "--check wrote something"

    first = run_cli("apply", "--vllm", str(site), *only)
    assert first.returncode == 0, first.stdout + first.stderr
    once = tree_hashes(site)
    assert changed_sources(original, once) == set(written), "apply wrote other files"
    applied = status_json(site, *only)
    assert (applied["_rc"], applied["patches"][0]["verdict"]) == (0, "applied"), applied
    if while_applied is not None:
        while_applied(applied)
        assert tree_hashes(site) == once, "while_applied changed the tree"

    second = run_cli("apply", "--vllm", str(site), *only)
    assert second.returncode == 0, second.stdout + second.stderr
    assert tree_hashes(site) == once, "a second apply changed bytes"

    back = run_cli("revert", "--vllm", str(site))
    assert back.returncode == 0, back.stdout + back.stderr
    assert tree_hashes(site) == original, "revert is not byte-identical"
    return Cycle(pending, applied)
