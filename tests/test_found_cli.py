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


ASCII_OUTPUT = {
    "PYTHONIOENCODING=ascii": {"PYTHONIOENCODING": "ascii"},
    # The C locale with Python's own UTF-8 rescue (PEP 538, PEP 540) turned off.
    "C locale": {
        "LC_ALL": "C",
        "LANG": "C",
        "PYTHONUTF8": "0",
        "PYTHONCOERCECLOCALE": "0",
        "PYTHONIOENCODING": "",
    },
}


@pytest.mark.parametrize("output", list(ASCII_OUTPUT))
def test_an_ascii_stdout_gets_the_report_with_what_it_cannot_encode_replaced(
    make_tree, tmp_path, output
):
    """PYTHONIOENCODING=ascii (or a C locale): a report holding one non-ASCII character (here
    the tree's path) was dropped whole: no report, one stderr line 'could not write the output'.
    Every line is printed, that character replaced, never a traceback or silence. (The C locale
    case passed before the fix too: Python reads the path in as surrogate escapes and writes
    them back as the same bytes; it stays as a guard.)"""
    import shutil

    site = tmp_path / "sit\u00e9"
    shutil.copytree(make_tree("0.31.0"), site)
    env = ASCII_OUTPUT[output]
    for command, code in (("status", 1), ("apply", 0), ("status", 0), ("revert", 0)):
        proc = run_cli(command, "--vllm", str(site), env=env)
        assert proc.returncode == code, (command, proc.stdout, proc.stderr)
        assert proc.stderr == "", (command, proc.stderr)
        if command == "revert":
            assert "restored:\n  vllm/_aiter_ops.py" in proc.stdout, proc.stdout
        else:
            # (the C locale gives the path back as the bytes it came in as)
            assert "aiter-mla-gfx942" in proc.stdout, proc.stdout
            assert "sit?" in proc.stdout or "sit\u00e9" in proc.stdout, proc.stdout


def test_status_quiet_and_apply_quiet_print_one_line_format(make_tree):
    """`status --quiet` printed `id: verdict` and `apply --quiet` `k3patch: id: verdict` (what
    README gives): one format, on the full path and the no-op path alike."""
    import re

    site = make_tree("0.31.0")

    def lines(*args: str, full: bool = False) -> list[str]:
        env = {"K3PATCH_NO_FASTPATH": "1"} if full else {}
        proc = run_cli(*args, "--quiet", "--vllm", str(site), env=env)
        assert proc.returncode in (0, 1), proc.stderr
        return proc.stdout.splitlines()

    pending = lines("status")
    assert pending == lines("apply", "--check")
    assert lines("apply") == [x.replace(": pending", ": applied") for x in pending]
    applied = lines("apply", full=True)
    for run in (lines("status"), lines("status", full=True), lines("apply")):
        assert run == applied, (run, applied)
    assert len(applied) == 4 and all(
        re.fullmatch(r"k3patch: [a-z0-9-]+: [a-z ]+", x) for x in applied
    )


@pytest.mark.parametrize("applied_first", [False, True], ids=["pending", "applied"])
def test_a_directory_named_like_a_target_is_refused_and_nothing_written(make_tree, applied_first):
    """`vllm/_aiter_ops.py/` a directory (a package dir named like a target file): every command
    refuses it in one line, exit 2 (docs/exit-codes.md), nothing written. Already so before this
    round (a FIFO at a target, exit 3, is tests/test_disk_links_and_fifos.py's); kept as a guard."""
    site = make_tree("0.31.0")
    if applied_first:
        assert run_cli("apply", "--vllm", str(site), "-q").returncode == 0
    target = site / "vllm/_aiter_ops.py"
    target.unlink()
    target.mkdir()
    before = _everything(site)
    for command in ("status", "apply", "revert", "verify"):
        proc = run_cli(command, "--vllm", str(site))
        if command == "revert" and not applied_first:
            assert proc.returncode == 0 and "nothing to revert" in proc.stdout, proc.stdout
            continue
        assert proc.returncode == 2, (command, proc.stdout, proc.stderr)
        assert proc.stderr.splitlines() == [
            f"k3patch: error: {target} is a directory, expected a Python file"
        ], proc.stderr
        assert _everything(site) == before, command
