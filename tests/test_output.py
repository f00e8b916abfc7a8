"""What an operator reads: reports that fit a log line and a terminal, help without Python types,
and `status --diff`, the change k3patch made and nothing else."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import run_cli, slow_after

LOG_WIDTH = 100
COMMANDS = ["list", "status", "apply", "revert", "verify"]
# What Typer prints for a parameter without a metavar, and Python's own type names.
TYPE_NAMES = re.compile(r"<[a-z]+(\[[a-z]+\])?>|\b(bool|str|float|int|list\[str\])\b")


def long_lines(text: str, width: int) -> list[str]:
    return [line for line in text.splitlines() if len(line) > width]


def reports(site: Path) -> dict[str, str]:
    """Every human report of a tree as a log gets it: before, during and after apply."""
    out = {}
    for name, args in [
        ("status pending", ["status"]),
        ("status --sites", ["status", "--sites"]),
        ("apply --check", ["apply", "--check"]),
        ("apply", ["apply"]),
        ("apply --quiet", ["apply", "--quiet"]),
        ("status applied", ["status", "--sites"]),
        ("status full path", ["status", "--sites"]),
    ]:
        env = {"K3PATCH_NO_FASTPATH": "1"} if name == "status full path" else None
        proc = run_cli(*args, "--vllm", str(site), env=env)
        assert proc.returncode in (0, 1), (name, proc.stderr)
        out[name] = proc.stdout
    return out


@pytest.mark.wheel
@pytest.mark.parametrize("version", slow_after(["0.29.0", "0.31.0", "0.33.0"]))
def test_log_lines_fit_100_columns_on_real_trees(make_tree, version):
    site = make_tree(version)
    for name, text in reports(site).items():
        assert text.strip(), name
        assert long_lines(text, LOG_WIDTH) == [], name


@pytest.mark.wheel
def test_log_lines_fit_100_columns_on_a_fork_tree(fork_tree):
    site = fork_tree("a")
    texts = reports(site)
    for name, text in texts.items():
        assert long_lines(text, LOG_WIDTH) == [], name
    # The fork tree has patches that need a look: their sites are detailed, the good ones not.
    status = texts["status pending"]
    assert "  rocm_aiter_ops.is_mla_enabled: pending" in status
    assert "    vllm/_aiter_ops.py:" in status


def test_list_is_compact_and_fits():
    proc = run_cli("list")
    assert proc.returncode == 0
    assert long_lines(proc.stdout, LOG_WIDTH) == []
    from k3patch.registry import all_patches

    patch_lines = [line for line in proc.stdout.splitlines() if not line.startswith(" ")]
    assert [line.split()[0] for line in patch_lines] == [p.id for p in all_patches()]


@pytest.mark.wheel
def test_default_status_details_only_sites_that_need_a_look(make_tree):
    site = make_tree("0.31.0")
    text = run_cli("status", "--vllm", str(site)).stdout
    lines = text.splitlines()
    # One line per patch, starting in column 0 with the id and the verdict.
    assert any(re.match(r"aiter-mla-gfx942 +pending +upstream", line) for line in lines)
    assert any(re.match(r"moriio-group-routing +satisfied", line) for line in lines)
    # Pending sites get their file:line; a satisfied one does not.
    assert "  build_connector_meta G1 (cached requests): pending" in text
    assert "  layer -> KV-cache group map: satisfied" not in text
    full = run_cli("status", "--vllm", str(site), "--sites").stdout
    assert "  layer -> KV-cache group map: satisfied" in full


@pytest.mark.wheel
def test_apply_names_what_it_wrote(make_tree):
    site = make_tree("0.31.0")
    text = run_cli("apply", "--vllm", str(site)).stdout
    assert re.search(r"^aiter-mla-gfx942 +applied +was upstream .*wrote _aiter_ops.py$", text, re.M)
    assert "\n  vllm/_aiter_ops.py\n" in text


def run_in_tty(args: list[str], columns: int) -> str:
    """The CLI with its stdout on a pseudo-terminal of `columns` columns; returns what it
    printed, colour codes removed."""
    import fcntl
    import pty
    import struct
    import termios

    pid, fd = pty.fork()
    if pid == 0:  # the child: a terminal of the given size, then the CLI
        fcntl.ioctl(0, termios.TIOCSWINSZ, struct.pack("HHHH", 50, columns, 0, 0))
        env = {**os.environ, "COLUMNS": str(columns), "TERM": "xterm-256color"}
        env.pop("NO_COLOR", None)
        os.execve(sys.executable, [sys.executable, "-m", "k3patch", *args], env)
    output = bytearray()
    while True:
        try:
            chunk = os.read(fd, 65536)
        except OSError:
            break
        if not chunk:
            break
        output.extend(chunk)
    os.waitpid(pid, 0)
    text = output.decode(errors="replace").replace("\r\n", "\n")
    return re.sub(r"\x1b\[[0-9;]*m", "", text)


@pytest.mark.wheel
def test_terminal_at_80_columns_folds_no_word(make_tree):
    """At 80 columns the report is wrapped by k3patch on spaces: no line reaches the edge, so
    the terminal never folds an id or a path in the middle."""
    import shutil
    import tempfile

    short = Path(tempfile.mkdtemp(prefix="k3t-"))  # pytest's tmp paths alone fill 80 columns
    site = short / "site"
    shutil.move(str(make_tree("0.31.0")), site)
    try:
        _check_terminal_output(site)
    finally:
        shutil.rmtree(short)


def _check_terminal_output(site: Path) -> None:
    for args in (["status"], ["status", "--sites"], ["list"]):
        text = run_in_tty([*args, "--vllm", str(site)] if args[0] != "list" else args, 80)
        assert text.strip(), args
        assert long_lines(text, 80) == [], args
        for word in (
            "kda-gather-diagnostic",
            "moriio-group-routing",
            "distributed/kv_transfer/kv_connector/v1/moriio/moriio_connector.py",
        ):
            assert word in text, (args, word)
    coloured = run_in_tty(["status", "--vllm", str(site)], 80)
    assert re.search(r"^moriio-chunk-gate +pending", coloured, re.M)


@pytest.mark.parametrize("command", ["", *COMMANDS])
def test_help_has_no_python_type_names(command):
    args = [command, "--help"] if command else ["--help"]
    proc = run_cli(*args, env={"COLUMNS": "100"})
    assert proc.returncode == 0, proc.stderr
    assert "--help" in proc.stdout
    found = [m.group(0) for m in TYPE_NAMES.finditer(proc.stdout)]
    assert found == [], found


def test_help_names_what_options_take():
    text = run_cli("apply", "--help", env={"COLUMNS": "120"}).stdout
    assert re.search(r"--vllm +PATH", text) and re.search(r"--only +ID", text)
    assert re.search(r"--lock-timeout +SECONDS", text)
    text = run_cli("verify", "--help", env={"COLUMNS": "120"}).stdout
    assert re.search(r"--python +PATH", text) and re.search(r"--module +MODULE", text)


def diff_files(diff: str) -> list[str]:
    return re.findall(r"^\+\+\+ b/(\S+)", diff, re.M)


@pytest.mark.wheel
def test_status_diff_shows_k3patchs_change_and_nothing_else(make_tree):
    site = make_tree("0.31.0")
    none_yet = run_cli("status", "--diff", "--vllm", str(site))
    assert "k3patch has changed nothing in this tree" in none_yet.stdout
    planned = run_cli("apply", "--check", "--diff", "--vllm", str(site)).stdout
    planned = planned[: planned.index("vLLM ")]  # the diff comes before the report
    assert diff_files(planned) == [
        "vllm/_aiter_ops.py",
        "vllm/distributed/kv_transfer/kv_connector/v1/moriio/moriio_connector.py",
    ]
    assert run_cli("apply", "--quiet", "--vllm", str(site)).returncode == 0
    # A file k3patch did not write changes too: it is not k3patch's change, it must not show.
    envs = site / "vllm" / "envs.py"
    envs.write_text(envs.read_text() + "\n# edited by hand\n")
    proc = run_cli("status", "--diff", "--vllm", str(site))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == planned  # exactly the edit apply made, hunk for hunk
    data = json.loads(run_cli("status", "--diff", "--json", "--vllm", str(site)).stdout)
    assert data["diff"] == planned and data["exit_code"] == 0
    assert run_cli("revert", "--vllm", str(site)).returncode == 0
    after = run_cli("status", "--diff", "--vllm", str(site)).stdout
    assert "k3patch has changed nothing in this tree" in after


@pytest.mark.wheel
def test_status_diff_shows_a_later_edit_of_a_patched_file(make_tree):
    site = make_tree("0.31.0")
    assert run_cli("apply", "--quiet", "--vllm", str(site)).returncode == 0
    target = site / "vllm" / "_aiter_ops.py"
    target.write_text(target.read_text() + "# a hot fix by hand\n")
    diff = run_cli("status", "--diff", "--vllm", str(site)).stdout
    assert "+# a hot fix by hand" in diff
    assert diff_files(diff)[0] == "vllm/_aiter_ops.py"


@pytest.mark.wheel
def test_revert_prints_its_bytecode_lines(make_tree):
    site = make_tree("0.31.0")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    assert run_cli("apply", "--quiet", "--vllm", str(site)).returncode == 0
    subprocess.run(  # the patched code's bytecode, which revert removes
        [sys.executable, "-m", "compileall", "-q", str(site / "vllm" / "_aiter_ops.py")],
        check=True,
        env=env,
    )
    proc = run_cli("revert", "--vllm", str(site))
    assert proc.returncode == 0, proc.stderr
    assert "\n  vllm/_aiter_ops.py\n" in proc.stdout
    bytecode = [line for line in proc.stdout.splitlines() if line.startswith("bytecode: ")]
    assert bytecode and "_aiter_ops" in bytecode[0], proc.stdout


@pytest.mark.wheel
@pytest.mark.verify
def test_verify_says_what_it_runs_and_to_apply_first(make_tree, verify_python):
    site = make_tree("0.31.0", full=True)
    proc = run_cli("verify", "--vllm", str(site), "--python", verify_python)
    assert proc.returncode == 1
    # Before the child starts (seconds, it imports torch): which interpreter, how much. The
    # line breaks between words wherever the interpreter's path (the checkout's: any length)
    # puts them; read as a log reader rejoins it. The path itself is never cut: it stands
    # whole on one line of stderr and of the report.
    said = " ".join(proc.stderr.split())
    assert re.match(r"verify: importing \d+ module\(s\) and running \d+ probe\(s\) with ", said)
    assert f" with {verify_python} (given by --python)" in said, said
    for text in (proc.stderr, proc.stdout):
        assert any(verify_python in row for row in text.splitlines()), text
    assert "probes ran: moriio-group-routing" in proc.stdout
    record = " ".join(proc.stdout.split())
    assert "aiter-mla-gfx942, moriio-chunk-gate pending: run `k3patch apply` first" in record
    # Only a word too long for the width (a path) stands longer than it, alone on its line.
    too_long = long_lines(proc.stdout, LOG_WIDTH)
    assert [row for row in too_long if " " in row.strip() and row.strip() != verify_python] == []


def test_version_is_printed_without_the_cli_stack():
    """The entrypoint logs `k3patch --version` on every start: it must cost an interpreter, not
    typer's import."""
    from k3patch import __version__

    proc = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "k3patch", "--version"],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0 and proc.stdout == f"k3patch {__version__}\n"
    imported = {line.rsplit("|", 1)[-1].strip() for line in proc.stderr.splitlines()}
    assert "typer" not in imported and "rich" not in imported
    # With anything after it, the CLI refuses it: `k3patch --version apply` must not exit 0
    # as if apply had run (test_cli.py).
    full = run_cli("--version", "--help")
    assert full.returncode == 2 and not full.stdout


@pytest.mark.wheel
def test_apply_diff_marks_a_last_line_without_newline(make_tree):
    """`apply --diff` marks a last line without its newline as `diff -u` and `status --diff`
    do; unmarked, the next file's `---` header ran onto that line."""
    site = make_tree("0.31.0")
    target = site / "vllm" / "_aiter_ops.py"
    text = target.read_text()
    end = text.index("\n", text.index("return cls._AITER_ENABLED and cls._MLA_ENABLED"))
    target.write_text(text[:end])  # the file ends with is_mla_enabled, and no newline
    planned = run_cli("apply", "--check", "--diff", "--vllm", str(site)).stdout
    planned = planned[: planned.index("vLLM ")]
    marker = "\n\\ No newline at end of file\n"
    assert f"return cls._AITER_ENABLED and cls._MLA_ENABLED{marker}" in planned
    assert f"return not on_gfx942(){marker}--- a/vllm/distributed/" in planned
    assert run_cli("apply", "--quiet", "--vllm", str(site)).returncode == 0
    assert run_cli("status", "--diff", "--vllm", str(site)).stdout == planned


def on_a_terminal(*args: str, columns: str) -> str:
    """The CLI's output (stdout and stderr) as a terminal of COLUMNS=`columns` shows it, through
    script(1): the terminal a user's shell gives it, not a pty of the test's own making."""
    command = shlex.join([sys.executable, "-m", "k3patch", *args])
    env = {**os.environ, "COLUMNS": columns, "NO_COLOR": "1"}
    proc = subprocess.run(
        ["script", "-qec", command, "/dev/null"], capture_output=True, text=True, env=env
    )
    return proc.stdout.replace("\r\n", "\n")


@pytest.mark.wheel
@pytest.mark.skipif(shutil.which("script") is None, reason="needs script(1) for a terminal")
def test_columns_0_on_a_terminal_still_prints_every_line(make_tree, tmp_path):
    """COLUMNS=0 on a terminal is no width: the report falls back to the log's width, and the
    report and an error line are still printed, never an empty screen or a traceback."""
    site = make_tree("0.31.0")
    out = on_a_terminal("status", "--vllm", str(site), columns="0")
    assert "aiter-mla-gfx942" in out and "digest " in out, out
    err = on_a_terminal("status", "--vllm", str(tmp_path / "nowhere"), columns="0")
    assert "k3patch: error:" in err, err


@pytest.mark.wheel
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


@pytest.mark.wheel
def test_status_diff_with_a_form_feed_is_a_patch_that_applies(make_tree):
    """A file holding a form feed (Python reads it as whitespace): the diff counts lines as
    `patch` does, so `patch -R` gives back the original byte for byte."""
    if shutil.which("patch") is None:
        pytest.skip("needs patch(1)")
    site = make_tree("0.31.0")
    target = site / "vllm" / "_aiter_ops.py"
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


@pytest.mark.wheel
def test_apply_json_always_has_bugs_and_diff_under_diff(make_tree):
    """README lists `bugs` and, with --diff, `diff`: present when empty too."""
    site = make_tree("0.31.0")
    first = json.loads(run_cli("apply", "--json", "--vllm", str(site)).stdout)
    assert first["bugs"] == {} and first["written"]
    again = run_cli("apply", "--json", "--diff", "--vllm", str(site))
    data = json.loads(again.stdout)
    assert data["exit_code"] == 0 and data["bugs"] == {} and data["diff"] == ""


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


@pytest.mark.wheel
@pytest.mark.parametrize("output", list(ASCII_OUTPUT))
def test_an_ascii_stdout_gets_the_report_with_what_it_cannot_encode_replaced(
    make_tree, tmp_path, output
):
    """PYTHONIOENCODING=ascii (or a C locale): a report holding a non-ASCII character (here
    the tree's path) is printed whole, every line, that character replaced; never dropped for
    one 'could not write the output' line, a traceback or silence. (Under the C locale Python
    reads the path in as surrogate escapes and writes them back as the same bytes.)"""
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


@pytest.mark.wheel
def test_status_quiet_and_apply_quiet_print_one_line_format(make_tree):
    """`status --quiet` and `apply --quiet` print one line format, `k3patch: id: verdict`
    (README's), on the full path and the no-op path alike."""
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


@pytest.mark.wheel
def test_status_quiet_names_an_interrupted_runs_journal(make_tree):
    """`status --quiet` on a tree whose revert was killed: every patch still reads applied, yet
    the exit is 1 (the journal: the next run rolls back); its lines must say why, as the full
    `status` does, not hide the journal behind "applied"."""
    site = make_tree("0.31.0")
    assert run_cli("apply", "--vllm", str(site)).returncode == 0
    killed = run_cli("revert", "--vllm", str(site), env={"K3PATCH_TEST_CRASH_AT": "blobs-written"})
    assert killed.returncode == 137 and (site / "vllm/.k3patch/journal.json").exists()
    full, quiet = (
        run_cli("status", "--vllm", str(site)),
        run_cli("status", "-q", "--vllm", str(site)),
    )
    journal = "an interrupted k3patch revert left a journal"
    assert full.returncode == quiet.returncode == 1 and journal in full.stdout
    assert journal in quiet.stdout, quiet.stdout
    assert "k3patch: aiter-mla-gfx942: applied" in quiet.stdout
