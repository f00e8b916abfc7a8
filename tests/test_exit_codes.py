"""What k3patch prints and the code it exits with never lie: exit codes survive whatever
happens to stdout and stderr (a closed pipe, a full disk behind stdout, SIGINT), a usage error
is one line and, under --json, an error envelope, an error stays one line on a terminal, a
drift report reads as code, and verify never passes having verified nothing.

The CLI runs as a subprocess only where the process's own descriptors are the thing tested."""

from __future__ import annotations

import io
import json
import os
import shlex
import signal
import subprocess
import sys

import pytest
from conftest import interruptible, run_cli, slow_after
from disk_setups import bash
from typer.testing import CliRunner

from k3patch import engine, plaintext, render, scan
from k3patch.cli import app
from k3patch.tree import locate

K3 = [sys.executable, "-m", "k3patch"]


def shell(command: str, env: dict[str, str] | None = None) -> tuple[int, list[str]]:
    """`command` in sh, with $K3 the CLI and fd 3 the shell's stdout (where the command echoes
    the CLI's own code, whatever a pipeline makes of it); that code and the stderr lines."""
    # $K3 expands unquoted (word splitting ignores quotes): the interpreter's path, which may
    # hold a space, comes quoted in the command itself.
    command = command.replace("$K3", shlex.join(K3))
    full = {**os.environ, "NO_COLOR": "1", **(env or {})}
    proc = subprocess.run(
        ["sh", "-c", "exec 3>&1; " + command], capture_output=True, text=True, env=full, timeout=120
    )
    return int(proc.stdout.strip()), [line for line in proc.stderr.splitlines() if line.strip()]


# How each kind of broken output is made, and whether the run may say so in one stderr line
# (a closed pipe is quiet: `| head -1` is normal; a closed stderr has nowhere to say anything).
OUTPUTS = {
    "stdout closed": ("$K3 {args} >&- 3>&-; echo $? >&3", True),
    "stdout full": ("$K3 {args} >/dev/full 3>&-; echo $? >&3", True),
    "stdout a closed pipe": ("{{ $K3 {args} 3>&-; echo $? >&3; }} | (exec 0<&-; sleep 1)", False),
    "stderr closed": ("$K3 {args} >/dev/null 2>&- 3>&-; echo $? >&3", False),
}


@pytest.fixture(scope="module")
def applied_site(tmp_path_factory):
    from conftest import _copy_minimal, pristine_tree

    from k3patch.registry import all_patches
    from k3patch.scan import target_files

    site = tmp_path_factory.mktemp("outputs") / "site"
    _copy_minimal(pristine_tree("0.31.0"), site, target_files(all_patches()))
    assert run_cli("apply", "--vllm", str(site), "--quiet").returncode == 0
    return site


@pytest.mark.wheel
@pytest.mark.parametrize("output", slow_after(OUTPUTS))
def test_exit_codes_survive_any_output(applied_site, output):
    template, says = OUTPUTS[output]
    site = str(applied_site)
    cases = [
        ("--version", 0, {}),
        ("list", 0, {}),
        ("list --json", 0, {}),
        (f"status --vllm {site}", 0, {}),  # the no-op path
        (f"status --vllm {site} --json", 0, {"K3PATCH_NO_FASTPATH": "1"}),
        ("status --vllm /nonexistent/k3patch --json", 2, {}),  # an error, as JSON
        (f"apply --vllm {site} --lock-timeout abc", 2, {}),  # a usage error
    ]
    for args, want, env in cases:
        command = template.format(args=args)
        code, lines = shell(command, env)
        assert code == want, (command, lines)
        assert not any("Traceback" in line for line in lines), (command, lines)
        allowed = 0 if output == "stderr closed" else 1 if says or want else 0
        assert len(lines) <= allowed, (command, lines)


def test_debug_shows_tracebacks_of_internal_errors_only_and_keeps_the_code(make_tree, monkeypatch):
    from k3patch.registry import all_patches

    monkeypatch.setenv("K3PATCH_DEBUG", "1")
    result = CliRunner().invoke(app, ["status", "--vllm", "/nonexistent/k3patch"])
    assert result.exit_code == 2 and "Traceback" not in result.stderr
    assert len(result.stderr.splitlines()) == 1
    site = make_tree("0.31.0")
    patch = next(p for p in all_patches() if p.id == "aiter-mla-gfx942")

    def explode(self, sources):
        raise RuntimeError("a bug in a patch")

    monkeypatch.setattr(type(patch), "classify", explode)
    result = CliRunner().invoke(app, ["status", "--vllm", str(site)])
    assert result.exit_code == 2  # as without K3PATCH_DEBUG
    assert "Traceback" in result.stderr and "RuntimeError: a bug in a patch" in result.stderr
    assert result.stderr.splitlines()[-1].startswith("k3patch: error: internal error")


@pytest.mark.wheel
def test_sigint_is_one_line_and_130(make_tree, tmp_path):
    """Interrupted while verify waits for its child (a stand-in that sleeps): one line, 130."""
    slow = tmp_path / "python"
    slow.write_text("#!/bin/sh\nsleep 60\n")
    slow.chmod(0o755)
    proc = subprocess.Popen(
        # With SIGINT at its default, also when this suite runs as a background job (conftest).
        interruptible([*K3, "verify", "--vllm", str(make_tree("0.31.0")), "--python", str(slow)]),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stderr is not None
    assert proc.stderr.readline().startswith("verify: importing")  # the child is running
    proc.send_signal(signal.SIGINT)
    err = proc.stderr.read()
    assert proc.wait(timeout=60) == 130
    # The one line after the progress report (which may wrap: the path is long).
    assert err.splitlines()[-1] == "k3patch: interrupted" and "Traceback" not in err
    assert err.count("k3patch:") == 1


# ---------------------------------------------------------------------------------------------
# Item 8: usage errors.


@pytest.mark.parametrize(
    "args, says",
    [
        (["apply", "--lock-timeout", "-1"], "-1.0 is not a finite number of seconds"),
        (["apply", "--lock-timeout", "nan"], "nan is not a finite number of seconds"),
        (["apply", "--lock-timeout", "abc"], "Invalid value for '--lock-timeout'"),
        (["revert", "--lock-timeout", "inf"], "inf is not a finite number of seconds"),
        (["status", "--lock-timeout", "nan"], "nan is not a finite number of seconds"),
        (["status", "--only", "no-such-patch"], "unknown patch 'no-such-patch'"),
        (["status", "--bogus"], "No such option: --bogus"),
        (["revert", "--sites"], "No such option: --sites"),  # an option revert does not have
        (["list", "--vllm", "x"], "No such option: --vllm"),
    ],
)
def test_a_usage_error_is_one_line_and_a_json_envelope(make_tree, args, says):
    site = str(make_tree("0.31.0"))
    argv = [*args, "--json"] if args[0] == "list" else [*args, "--vllm", site, "--json"]
    result = CliRunner().invoke(app, argv)
    assert result.exit_code == 2, result.output
    data = json.loads(result.stdout)
    assert data["exit_code"] == 2 and data["command"] == args[0] and data["schema_version"] == 1
    assert says in data["error"] and "\n" not in data["error"]
    (line,) = result.stderr.splitlines()
    assert line.startswith("k3patch: error: ") and says in line
    # Without --json: the same one line, nothing on stdout.
    result = CliRunner().invoke(app, [a for a in argv if a != "--json"])
    assert result.exit_code == 2 and not result.stdout
    assert len(result.stderr.splitlines()) == 1 and says in result.stderr


@pytest.mark.wheel
def test_the_no_op_path_refuses_what_the_full_path_refuses(applied_site):
    """A tree with nothing to do (a fresh record) never takes the lock, so --lock-timeout must
    be checked where it is parsed."""
    for bad in ("-1", "nan", "inf", "abc"):
        proc = run_cli("apply", "--vllm", str(applied_site), "--json", "--lock-timeout", bad)
        assert proc.returncode == 2, (bad, proc.stdout, proc.stderr)
        assert json.loads(proc.stdout)["exit_code"] == 2


# ---------------------------------------------------------------------------------------------
# Item 12: an error on a terminal is one line.


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_an_error_on_a_terminal_is_one_line(monkeypatch):
    monkeypatch.setenv("COLUMNS", "40")
    monkeypatch.delenv("NO_COLOR", raising=False)
    err = Terminal()
    monkeypatch.setattr(sys, "stderr", err)
    path = "/tmp/" + "a-long-directory-name/" * 6 + "with\na newline\x1b[31m"
    render.error_line(f"{path}: not a vLLM tree")
    text = err.getvalue()
    assert text.endswith("\n") and text.count("\n") == 1, text
    assert ("a-long-directory-name/" * 6 + "with\\na newline\\x1b[31m") in text


def test_a_control_character_in_a_path_is_escaped_in_the_cli(tmp_path):
    odd = tmp_path / "odd\nname"
    result = CliRunner().invoke(app, ["status", "--vllm", str(odd)])
    assert result.exit_code == 2
    (line,) = result.stderr.splitlines()
    assert "odd\\nname" in line


# ---------------------------------------------------------------------------------------------
# Item 13: drift reports read as code.

FOUND = (
    "def is_mla_enabled(cls) -> bool:\n"
    "    if cls._AITER_ENABLED:\n"
    "\n"
    "\treturn some_function_with_a_long_name(argument_one, argument_two, argument_three, "
    "argument_four, argument_five)\n"
    "    return False"
)
SITE = {
    "site": "rocm_aiter_ops.is_mla_enabled",
    "verdict": "drifted",
    "file": "_aiter_ops.py",
    "line": 12,
    "detail": "the site is in no shape k3patch knows; nothing will be written",
    "found": FOUND,
    "expected": ["upstream (0.12.0-0.33.0) (pending)", "def is_mla_enabled(cls):\n    return 1"],
}


def block_after(lines: list[str], head: str) -> list[str]:
    start = lines.index(head) + 1
    end = next(
        (
            i
            for i in range(start, len(lines))
            if lines[i].startswith("    ")
            and not lines[i].startswith("      ")
            and lines[i].strip()
        ),
        len(lines),
    )
    return lines[start:end]


def joined(block: list[str], margin: int = 6) -> list[str]:
    """A block's source lines, cut lines joined back at their `\\` marks."""
    out: list[str] = []
    carry = False
    for text in block:
        piece = text[margin:] if carry else text[margin:] if text else ""
        if carry:
            out[-1] += piece
        else:
            out.append(piece)
        carry = text.endswith("\\")
        if carry:
            out[-1] = out[-1][:-1]
    return out


@pytest.mark.parametrize("width", [100, 60])
def test_found_and_expected_are_preformatted_code_blocks(width):
    lines = plaintext.as_text(plaintext.site_lines(SITE), width).splitlines()
    assert all(len(text) <= width for text in lines), lines
    found = block_after(lines, "    found:")
    # Every source line, indentation kept (the tab expanded), the blank line too, never reflowed.
    assert joined(found) == [src.expandtabs(8) for src in FOUND.splitlines()]
    assert found[1] == "          if cls._AITER_ENABLED:" and found[2] == ""
    assert found[3].endswith("\\") and len(found[3]) == width  # a cut line, marked
    expected = block_after(lines, "    expected one of:")
    assert expected == [
        "      upstream (0.12.0-0.33.0) (pending)",
        "      def is_mla_enabled(cls):",
        "          return 1",
    ]


def test_the_terminal_renderer_prints_the_same_blocks(monkeypatch):
    monkeypatch.setenv("COLUMNS", "60")
    monkeypatch.setenv("NO_COLOR", "1")
    out = Terminal()
    monkeypatch.setattr(sys, "stdout", out)
    render.emit(plaintext.site_lines(SITE))
    import re

    shown = re.sub(r"\x1b\[[0-9;]*m", "", out.getvalue())  # NO_COLOR keeps bold
    assert shown.splitlines() == plaintext.as_text(plaintext.site_lines(SITE), 60).splitlines()


@pytest.mark.wheel
def test_found_code_keeps_its_indentation_under_its_def(make_tree):
    """A method found drifted is shown from its `def` at the margin, its body one level under
    it (the file's own layout), not the body at the file's column under an unindented `def`."""
    from k3patch.registry import all_patches
    from k3patch.tree import locate

    site = make_tree("0.31.0")
    target = site / "vllm" / "_aiter_ops.py"
    text = target.read_text()
    at = text.index("return", text.index("def is_mla_enabled"))
    end = text.index("\n", at)
    target.write_text(text[:end] + " and cls._AITER_ENABLED" + text[end:])
    aiter = tuple(p for p in all_patches() if p.id == "aiter-mla-gfx942")
    report = scan.scan(locate(str(site)), aiter, use_record=False)
    (drift,) = [r for r in report.results if r.verdict.value == "drifted"]
    lines = drift.found.splitlines()
    assert lines[0].startswith("def is_mla_enabled(cls)"), lines
    assert lines[1].startswith("    return cls._AITER_ENABLED and"), lines


@pytest.mark.parametrize("path", slow_after(["fast", "full"]))
def test_a_closed_pipe_or_a_full_stdout_after_a_commit_keeps_its_code(make_tree, path):
    """Issue 13 item 15: exit codes that do not lie."""
    k3 = shlex.join([sys.executable, "-m", "k3patch"])
    if path == "full":
        k3 = f"K3PATCH_NO_FASTPATH=1 {k3}"
    site, other = make_tree("0.31.0"), make_tree("0.31.0")
    at, other_at = shlex.quote(str(site)), shlex.quote(str(other))
    piped = bash(f"{k3} apply --vllm {at} | head -c 1 >/dev/null; exit ${{PIPESTATUS[0]}}")
    assert piped.returncode == 0, piped.stderr
    assert "Traceback" not in piped.stderr and "internal error" not in piped.stderr
    full = bash(f"{k3} apply --vllm {other_at} > /dev/full")
    assert full.returncode == 0, full.stderr
    assert "nothing was written" not in full.stderr and "could not write" in full.stderr
    for tree in (site, other):
        assert run_cli("status", "--vllm", str(tree)).returncode == 0
    status = bash(f"{k3} status --vllm {at} | head -c 1 >/dev/null; exit ${{PIPESTATUS[0]}}")
    assert status.returncode == 0, status.stderr


def test_a_non_executable_python_for_verify_is_exit_3(make_tree, tmp_path):
    """Issue 13 item 15: exit codes that do not lie."""
    site = make_tree("0.31.0")
    fake = tmp_path / "python"
    fake.write_text("#!/bin/sh\n")
    proc = run_cli("verify", "--vllm", str(site), "--python", str(fake))
    assert proc.returncode == 3, (proc.stdout, proc.stderr)


def test_verify_with_an_interpreter_lacking_torch_is_exit_3(make_tree):
    """Issue 13 item 16: verify never passes vacuously."""
    site = make_tree("0.31.0")
    engine.apply(locate(site))
    proc = run_cli("verify", "--vllm", str(site))  # k3patch's own interpreter: no torch
    assert proc.returncode == 3, (proc.stdout, proc.stderr)
    assert "nothing was verified" in proc.stderr and sys.executable in proc.stderr
    assert "verified" not in proc.stdout
