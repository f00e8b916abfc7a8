"""The smaller classes of issue 26: SIGTERM during verify, COLUMNS=0 on a terminal, a tree path
with a space in a log, form feeds in `status --diff`, and the fields `apply --json` always has.
Each failed on main."""

from __future__ import annotations

import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import run_cli
from test_verify import stand_in

pytestmark = pytest.mark.wheel
AITER = "_aiter_ops.py"


def _state(pid: int) -> str | None:
    """The process's state letter (R, S, Z, ...), None when it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except FileNotFoundError:
        return None
    return fields[0]


def test_sigterm_during_verify_ends_its_child_too(make_tree, tmp_path):
    """`docker stop` while verify's child imports torch: the child goes with k3patch (as it
    does for SIGINT), and k3patch ends as SIGTERM ends a process. On main the child ran on."""
    site = make_tree("0.31.0")
    pid_file = tmp_path / "child.pid"
    python = stand_in(
        tmp_path,
        f"import os, time\nopen({str(pid_file)!r}, 'w').write(str(os.getpid()))\ntime.sleep(120)",
    )
    proc = subprocess.Popen(
        [sys.executable, "-m", "k3patch", "verify", "--vllm", str(site), "--python", python],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 60
    while not (pid_file.exists() and pid_file.read_text()):
        assert proc.poll() is None and time.monotonic() < deadline
        time.sleep(0.05)
    child = int(pid_file.read_text())
    try:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == -signal.SIGTERM
        deadline = time.monotonic() + 10
        while _state(child) not in (None, "Z") and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _state(child) in (None, "Z"), f"the verify child {child} still runs"
    finally:
        if _state(child) not in (None, "Z"):
            os.kill(child, signal.SIGKILL)


def on_a_terminal(*args: str, columns: str) -> str:
    """The CLI's output (stdout and stderr) as a terminal of COLUMNS=`columns` shows it."""
    command = shlex.join([sys.executable, "-m", "k3patch", *args])
    env = {**os.environ, "COLUMNS": columns, "NO_COLOR": "1"}
    proc = subprocess.run(
        ["script", "-qec", command, "/dev/null"], capture_output=True, text=True, env=env
    )
    return proc.stdout.replace("\r\n", "\n")


@pytest.mark.skipif(shutil.which("script") is None, reason="needs script(1) for a terminal")
def test_columns_0_on_a_terminal_still_prints_every_line(make_tree, tmp_path):
    site = make_tree("0.31.0")
    out = on_a_terminal("status", "--vllm", str(site), columns="0")
    assert "aiter-mla-gfx942" in out and "digest " in out, out
    err = on_a_terminal("status", "--vllm", str(tmp_path / "nowhere"), columns="0")
    assert "k3patch: error:" in err, err


def test_a_tree_path_with_spaces_is_never_cut_in_a_log(make_tree, tmp_path):
    """The header names the tree whole on one line, however many spaces its path has, even
    where the line is longer than the log's 100 columns."""
    deep = tmp_path / ("a dir with spaces " * 4).strip() / "my site"
    deep.parent.mkdir(parents=True)
    shutil.copytree(make_tree("0.31.0"), deep)
    package = str(deep / "vllm")
    for args in (["status"], ["apply"]):
        proc = run_cli(*args, "--vllm", str(deep))
        lines = proc.stdout.splitlines()
        assert any(line.endswith(package) for line in lines), proc.stdout


def test_status_diff_with_a_form_feed_is_a_patch_that_applies(make_tree):
    """A file holding a form feed (Python reads it as whitespace): the diff counts lines as
    `patch` does, so `patch -R` gives back the original byte for byte."""
    if shutil.which("patch") is None:
        pytest.skip("needs patch(1)")
    site = make_tree("0.31.0")
    target = site / "vllm" / AITER
    text = target.read_text()
    first = text.index("\n") + 1
    target.write_text(text[:first] + "# page one\x0c# page two\n" + text[first:])
    original = target.read_bytes()
    assert run_cli("apply", "--vllm", str(site), "--only", "aiter-mla-gfx942").returncode == 0
    target.write_text(target.read_text() + "\x0c# an edit after the form feed\n")
    diff = run_cli("status", "--diff", "--vllm", str(site)).stdout
    assert diff.startswith("--- a/vllm/_aiter_ops.py"), diff[:200]
    proc = subprocess.run(
        ["patch", "-p1", "-R", "--no-backup-if-mismatch"],
        input=diff,
        cwd=site,
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert target.read_bytes() == original


def test_apply_json_always_has_bugs_and_diff_under_diff(make_tree):
    """README lists `bugs` and, with --diff, `diff`: present when empty too."""
    site = make_tree("0.31.0")
    first = json.loads(run_cli("apply", "--json", "--vllm", str(site)).stdout)
    assert first["bugs"] == {} and first["written"]
    again = run_cli("apply", "--json", "--diff", "--vllm", str(site))
    data = json.loads(again.stdout)
    assert data["exit_code"] == 0 and data["bugs"] == {} and data["diff"] == ""
