"""Smaller CLI defects found by the write-path attack's last round: each test failed on the code
before its fix."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
from conftest import run_cli


def _everything(site: Path) -> dict[str, str]:
    return {
        p.relative_to(site).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in site.rglob("*")
        if p.is_file()
    }


@pytest.mark.parametrize("applied_first", [False, True], ids=["pending", "applied"])
def test_a_patch_both_selected_and_skipped_is_a_usage_error_on_every_command(
    make_tree, applied_first
):
    """`--only X --skip X` exited 0 on status and apply (nothing selected, nothing to do) but 3
    on verify ("nothing to verify"). A patch named by both is a usage error (exit 2, one line
    on stderr, nothing written) on every command, the no-op path of an applied tree included."""
    site = make_tree("0.31.0")
    if applied_first:
        assert run_cli("apply", "--vllm", str(site), "-q").returncode == 0
    before = _everything(site)
    pick = ["--only", "aiter-mla-gfx942", "--skip", "aiter-mla-gfx942"]
    for command in ("status", "apply", "verify"):
        proc = run_cli(command, "--vllm", str(site), *pick)
        assert proc.returncode == 2, (command, proc.stdout, proc.stderr)
        assert len(proc.stderr.splitlines()) == 1, (command, proc.stderr)
        assert "--only and --skip both name 'aiter-mla-gfx942'" in proc.stderr
        assert _everything(site) == before, command
