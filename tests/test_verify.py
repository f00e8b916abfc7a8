"""`verify` against a real vLLM 0.31.0 tree imported by an interpreter with torch (CPU):
imports really happen, the probe really runs, broken and blocked are told apart, and stale
unchecked-hash pycs do not keep the old code alive."""

from __future__ import annotations

import compileall
import json
import os
import py_compile
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import run_cli
from disk_setups import apply_killed_at, needs_strace

from k3patch import scan
from k3patch import verify as verify_mod
from k3patch.registry import all_patches
from k3patch.tree import locate

pytestmark = [pytest.mark.wheel, pytest.mark.verify]
AITER = "aiter-mla-gfx942"


def verify_json(site: Path, python: str, *extra: str) -> tuple[int, dict]:
    proc = run_cli(
        "verify", "--vllm", str(site), "--python", python, "--json", "--only", AITER, *extra
    )
    assert proc.stdout, proc.stderr
    return proc.returncode, json.loads(proc.stdout)


@pytest.fixture(scope="module")
def applied_tree(tmp_path_factory, request):
    import shutil

    from conftest import pristine_tree

    src = pristine_tree("0.31.0")
    site = tmp_path_factory.mktemp("verify") / "site"
    shutil.copytree(src, site, ignore=shutil.ignore_patterns(".complete"))
    assert run_cli("apply", "--vllm", str(site), "--only", AITER).returncode == 0
    return site


def test_verify_imports_and_runs_truth_table(applied_tree, verify_python):
    code, data = verify_json(applied_tree, verify_python, "--module", "vllm.platforms.rocm")
    assert code == 0, data
    check = data["verify"]["patches"][0]
    assert check["modules"] == [
        {"module": "vllm._aiter_ops", "status": "ok", "reason": "", "decided_by": ""}
    ]
    assert check["probe"]["ok"] is True
    # aiter probe: every spelling of VLLM_ROCM_USE_AITER_MLA, set and unset, on three archs
    assert len(check["probe"]["checks"]) == 385
    # No GPU here: vllm.platforms.rocm cannot import, and that is the environment's doing.
    rocm = data["verify"]["modules"][0]
    assert rocm["module"] == "vllm.platforms.rocm"
    assert rocm["status"] == "blocked by the environment"
    assert "original files fail too" in rocm["decided_by"]


def test_probe_fails_on_unpatched_code(probed):
    # The probe is only worth something if it can fail: run it on the upstream function (one
    # verify child for every patch's probe on this tree, shared with their tests: conftest).
    probe = probed("0.31.0", AITER)
    assert probe["ok"] is False
    assert "VLLM_ROCM_USE_AITER_MLA=unset gfx942 aiter=1 mla=1 -> True" in probe["summary"]


def test_broken_patched_file_is_reported_as_broken(applied_tree, verify_python, tmp_path):
    import shutil

    site = tmp_path / "site"
    shutil.copytree(applied_tree, site)
    target = site / "vllm" / "_aiter_ops.py"
    text = target.read_text()
    # Break the module outside the site, so the patch still reads as applied, and make it an
    # import-time failure the original does not have.
    target.write_text(
        text.replace(
            "import vllm.envs as envs\n",
            "import vllm.envs as envs\nimport vllm.no_such_module_k3\n",
            1,
        )
    )
    code, data = verify_json(site, verify_python)
    assert code == 1
    module = data["verify"]["patches"][0]["modules"][0]
    assert module["status"] == "broken by the patch"
    assert module["decided_by"] == "the original files import; the patched fail"


def test_syntax_error_in_patched_file_is_broken_without_original(
    applied_tree, verify_python, tmp_path
):
    import shutil

    site = tmp_path / "site"
    shutil.copytree(applied_tree, site)
    shutil.rmtree(site / "vllm" / ".k3patch")  # no record: no original to compare against
    target = site / "vllm" / "_aiter_ops.py"
    target.write_text(target.read_text() + "\ndef broken(:\n")
    proc = run_cli(
        "verify", "--vllm", str(site), "--python", verify_python, "--json", "--only", AITER
    )
    data = json.loads(proc.stdout)
    # A file that does not parse is drift to the classifier: verify says so and exits 1.
    assert proc.returncode == 1
    assert data["patches"][0]["verdict"] == "drifted"


@pytest.mark.slow
def test_unchecked_hash_pycs_are_removed_so_patched_code_runs(make_tree, verify_python):
    site = make_tree("0.31.0", full=True)
    target = site / "vllm" / "_aiter_ops.py"
    compileall.compile_file(
        str(target), quiet=1, invalidation_mode=py_compile.PycInvalidationMode.UNCHECKED_HASH
    )
    probe = (
        "import vllm._aiter_ops as m; f = m.rocm_aiter_ops.__dict__['is_mla_enabled'].__func__;"
        "f = getattr(f, '__wrapped__', f); print('is_set' in f.__code__.co_names)"
    )

    def patched_code_runs(writes_bytecode: bool = True) -> bool:
        env = {**os.environ, "PYTHONPATH": str(site)}
        env.pop("PYTHONDONTWRITEBYTECODE", None)
        if not writes_bytecode:
            env["PYTHONDONTWRITEBYTECODE"] = "1"
        out = subprocess.run(
            [verify_python, "-c", probe],
            env=env,
            capture_output=True,
            text=True,
            check=True,
            cwd=site,
        )
        return out.stdout.strip().splitlines()[-1] == "True"

    assert patched_code_runs() is False
    # The control: an edit that leaves the unchecked-hash pyc alone keeps the OLD code running.
    original = target.read_bytes()
    plain = site.parent / "plain"
    import shutil

    shutil.copytree(site, plain)
    from k3patch import engine

    # k3patch's own edit, planned in memory and written as a plain file write (no pyc care).
    aiter = tuple(p for p in all_patches() if p.id == AITER)
    the_plan = engine.plan(scan.scan(locate(plain), aiter, use_record=False))
    assert original.decode() == the_plan.sources["_aiter_ops.py"].text
    (plain / "vllm" / "_aiter_ops.py").write_text(the_plan.new_texts["_aiter_ops.py"])
    env = {**os.environ, "PYTHONPATH": str(plain)}
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    stale = subprocess.run(
        [verify_python, "-c", probe], env=env, capture_output=True, text=True, check=True, cwd=plain
    )
    assert stale.stdout.strip().splitlines()[-1] == "False", "stale pyc should hide the edit"
    # k3patch removes the pyc before the source changes: the patched code is what runs, also
    # where the interpreter may not write bytecode (a read-only tree runs from source).
    assert run_cli("apply", "--vllm", str(site), "--only", AITER).returncode == 0
    assert not list((site / "vllm" / "__pycache__").glob("_aiter_ops.*.pyc"))
    assert patched_code_runs(writes_bytecode=False) is True
    assert patched_code_runs() is True


# ---------------------------------------------------------------------------------------------
# verify tells the truth about its child. A stand-in interpreter (k3patch's own
# Python behind a script) prints what a broken or hostile one might; no torch needed.

MARKER = "K3PATCH-VERIFY-RESULT "


def stand_in(tmp_path: Path, body: str) -> str:
    """An executable that takes the child's arguments and runs `body` (Python) instead."""
    import sys

    code = tmp_path / "python.py"
    code.write_text(
        f"import json, sys\nargs = json.loads(sys.argv[2])\nMARKER = {MARKER!r}\n{body}\n"
    )
    # A shell shim, not a `#!` line: a shebang cannot name an interpreter whose path has a space.
    script = tmp_path / "python"
    script.write_text(
        f'#!/bin/sh\nexec {shlex.quote(sys.executable)} {shlex.quote(str(code))} "$@"\n'
    )
    script.chmod(0o755)
    return str(script)


GOOD_RESULT = (
    'result = {"python": "3.11.7", "imports": {m: {"ok": True} for m in args["modules"]},'
    ' "probes": {p: {"ok": True, "summary": "stand-in", "checks": []} for p in args["probes"]}}'
)


def test_odd_bytes_around_the_result_are_not_fatal(make_tree, tmp_path):
    python = stand_in(
        tmp_path,
        GOOD_RESULT + "\nsys.stdout.buffer.write(b'\\xff\\xfe import noise \\x80\\n')"
        "\nsys.stderr.buffer.write(b'\\xc3\\x28 warning\\n')\nsys.stdout.flush()"
        "\nprint(MARKER + json.dumps(result))",
    )
    verified = verify_mod.verify(locate(make_tree("0.31.0")), python=python)
    (routing,) = [c for c in verified.patches if c.probe_ok is not None]
    assert routing.patch_id == "moriio-group-routing" and routing.probe_summary == "stand-in"
    assert routing.ok and all(m.status == "ok" for m in routing.modules)


@pytest.mark.parametrize(
    "body, says",
    [
        (
            "sys.stderr.buffer.write(b'\\xff\\xfe died\\n'); sys.exit(1)",
            "exited 1: \ufffd\ufffd died",
        ),
        ("print(MARKER + '{not json')", "text that is not JSON"),
        ("print(MARKER + '[1, 2]')", "a JSON list"),
        ("print(MARKER + '{}')", "without its imports and probes"),
        ("print(MARKER + json.dumps({'imports': {}, 'probes': {}}))", "no import result for vllm."),
        (
            GOOD_RESULT + "\nfor p in result['probes']: result['probes'][p]['ok'] = 'yes'"
            "\nprint(MARKER + json.dumps(result))",
            "a malformed probe result for moriio-group-routing",
        ),
        (
            GOOD_RESULT + "\nfor m in result['imports']: result['imports'][m] = {'ok': False}"
            "\nprint(MARKER + json.dumps(result))",
            "a malformed import failure",
        ),
    ],
)
def test_a_child_result_that_is_not_one_is_exit_3_naming_the_interpreter(
    make_tree, tmp_path, body, says
):
    from k3patch.errors import VerifyError
    from k3patch.exitcodes import explain

    python = stand_in(tmp_path, body)
    with pytest.raises(VerifyError) as caught:
        verify_mod.verify(locate(make_tree("0.31.0")), python=python)
    assert says in str(caught.value) and python in str(caught.value)
    assert explain(caught.value)[0] == 3


def test_a_selection_that_leaves_nothing_verified_nothing(make_tree):
    from typer.testing import CliRunner

    from k3patch.cli import app
    from k3patch.registry import all_patches

    site = make_tree("0.31.0")
    skip_all = [arg for p in all_patches() for arg in ("--skip", p.id)]
    result = CliRunner().invoke(app, ["verify", "--vllm", str(site), *skip_all, "--json"])
    assert result.exit_code == 3, result.output
    assert "nothing to verify" in json.loads(result.stdout)["error"]
    # Every selected patch not applicable here: nothing imported, no probe run: not a pass.
    result = CliRunner().invoke(
        app, ["verify", "--vllm", str(site), "--only", "kda-gather-diagnostic"]
    )
    assert result.exit_code == 3, result.output
    assert "kda-gather-diagnostic not applicable" in result.stderr


def _state(pid: int) -> str | None:
    """The process's state letter (R, S, Z, ...), None when it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except FileNotFoundError:
        return None
    return fields[0]


def test_sigterm_during_verify_ends_its_child_too(make_tree, tmp_path):
    """`docker stop` while verify's child imports torch: the child goes with k3patch (as it
    does for SIGINT), and k3patch ends as SIGTERM ends a process."""
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


@needs_strace
@pytest.mark.parametrize("journal", ["fifo", "interrupted-apply"])
def test_verify_does_not_pass_a_tree_with_a_pending_or_unusable_journal(
    make_tree, verify_python, journal
):
    """Promise (docs/exit-codes.md): a FIFO at the journal is "refused without being opened,
    never waited on, by every command"; exit 1 covers "an interrupted run's journal is
    waiting"; README: k3patch never reports a state the tree is not in.

    `verify` is the last gate of the Dockerfile (`apply && status && verify`) and of an audit.
    On a tree whose `.k3patch/journal.json` is a FIFO, status, apply and revert exit 3; on one
    an apply was killed in (after `_aiter_ops.py` was exchanged, before the journal was
    removed: its next apply or revert rolls that file back), `status --only aiter-mla-gfx942`
    exits 1 and names the journal. `verify` on either must not exit 0 nor print "verified"
    (under `--json`, never exit_code 0 beside `error` or `interrupted`)."""
    site = make_tree("0.31.0", full=True)
    if journal == "fifo":
        assert run_cli("apply", "--vllm", str(site)).returncode == 0
        os.mkfifo(site / "vllm/.k3patch/journal.json")
        assert run_cli("status", "--vllm", str(site)).returncode == 3
    else:
        killed = apply_killed_at(site, "renameat2", 2)
        assert killed.returncode != 0
        assert (site / "vllm/.k3patch/journal.json").is_file()
        status = run_cli("status", "--vllm", str(site), "--only", "aiter-mla-gfx942")
        assert status.returncode == 1, status.stdout
    proc = run_cli(
        "verify",
        "--vllm",
        str(site),
        "--python",
        verify_python,
        "--only",
        "aiter-mla-gfx942",
        "--json",
        timeout=600,
    )
    data = json.loads(proc.stdout)
    assert proc.returncode != 0, (data.get("error"), data.get("interrupted"), proc.stderr)
