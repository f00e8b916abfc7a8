"""The CLI contract: finding the tree, exit codes, JSON, bad input, and internal errors that
must never read as drift."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import run_cli, tree_hashes
from typer.testing import CliRunner

from k3patch.cli import app
from k3patch.registry import all_patches
from k3patch.tree import TreeError, locate


def test_list_shows_every_patch():
    proc = run_cli("list", "--json")
    assert proc.returncode == 0
    data = json.loads(proc.stdout)
    assert data["schema_version"] == 1
    assert {p["id"] for p in data["patches"]} == {p.id for p in all_patches()}
    assert "aiter-mla-gfx942" in {p["id"] for p in data["patches"]}


def test_python_dash_m_and_version():
    proc = subprocess.run(
        [sys.executable, "-m", "k3patch", "--version"], capture_output=True, text=True
    )
    assert proc.returncode == 0
    assert proc.stdout.startswith("k3patch ")


def test_no_vllm_for_this_interpreter_is_environment(tmp_path):
    # The test interpreter has no vllm installed; run from an empty dir.
    proc = run_cli("status", cwd=tmp_path)
    assert proc.returncode == 3
    assert "no vLLM found" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1


def test_not_a_vllm_tree_is_usage(tmp_path):
    (tmp_path / "something").mkdir()
    proc = run_cli("status", "--vllm", str(tmp_path / "something"))
    assert proc.returncode == 2
    assert "not a vLLM tree" in proc.stderr
    proc = run_cli("apply", "--vllm", str(tmp_path / "missing"))
    assert proc.returncode == 2
    assert "no such directory" in proc.stderr


def test_unknown_patch_is_usage(make_tree):
    site = make_tree("0.31.0")
    proc = run_cli("status", "--vllm", str(site), "--only", "no-such-patch")
    assert proc.returncode == 2
    assert "unknown patch 'no-such-patch'" in proc.stderr


def test_json_errors_are_json(tmp_path):
    proc = run_cli("status", "--vllm", str(tmp_path), "--json")
    assert proc.returncode == 2
    data = json.loads(proc.stdout)
    assert data["exit_code"] == 2 and "not a vLLM tree" in data["error"]


@pytest.mark.wheel
@pytest.mark.parametrize("form", ["package", "site", "checkout"])
def test_tree_forms(make_tree, tmp_path, form):
    site = make_tree("0.31.0")
    if form == "package":
        tree = locate(site / "vllm")
        assert tree.kind == "site-packages" and tree.version == "0.31.0"
    elif form == "site":
        tree = locate(site)
        assert tree.package_dir == site / "vllm"
    else:
        checkout = tmp_path / "checkout"
        checkout.mkdir()
        (checkout / "pyproject.toml").write_text("[project]\nname = 'vllm'\n")
        os.rename(site / "vllm", checkout / "vllm")
        (checkout / "vllm" / "_version.py").write_text("__version__ = version = '0.31.1.dev5'\n")
        tree = locate(checkout)
        assert (tree.kind, tree.version) == ("source checkout", "0.31.1.dev5")
        assert run_cli("apply", "--vllm", str(checkout)).returncode == 0


@pytest.mark.wheel
def test_symlinked_package_dir_is_refused(make_tree, tmp_path):
    site = make_tree("0.31.0")
    link_site = tmp_path / "linked"
    link_site.mkdir()
    (link_site / "vllm").symlink_to(site / "vllm")
    before = tree_hashes(site)
    proc = run_cli("apply", "--vllm", str(link_site))
    assert proc.returncode == 2
    assert "is a symlink" in proc.stderr and str(site / "vllm") in proc.stderr
    assert tree_hashes(site) == before
    with pytest.raises(TreeError):
        locate(link_site / "vllm")


@pytest.mark.wheel
def test_symlinked_site_packages_patches_the_real_files(make_tree, tmp_path):
    # A link above the package (a venv's lib64 -> lib) is followed: the real files are
    # patched in place and the link stays a link.
    site = make_tree("0.31.0")
    link = tmp_path / "lib64"
    link.symlink_to(site)
    proc = run_cli("apply", "--vllm", str(link))
    assert proc.returncode == 0, proc.stderr
    assert link.is_symlink()
    assert "envs.is_set" in (site / "vllm" / "_aiter_ops.py").read_text()
    assert (site / "vllm" / ".k3patch" / "state.json").exists()


@pytest.mark.wheel
def test_symlinked_target_file_is_refused(make_tree, tmp_path):
    site = make_tree("0.31.0")
    target = site / "vllm" / "_aiter_ops.py"
    real = tmp_path / "real_aiter_ops.py"
    real.write_bytes(target.read_bytes())
    target.unlink()
    target.symlink_to(real)
    before = real.read_bytes()
    proc = run_cli("apply", "--vllm", str(site))
    assert proc.returncode == 2
    assert "is a symlink" in proc.stderr
    assert target.is_symlink() and real.read_bytes() == before


@pytest.mark.wheel
def test_internal_error_is_not_attention(make_tree, monkeypatch):
    site = make_tree("0.31.0")
    patch = next(p for p in all_patches() if p.id == "aiter-mla-gfx942")

    def explode(*args, **kwargs):
        raise RuntimeError("a bug in a patch")

    monkeypatch.setattr(type(patch), "classify", explode)
    result = CliRunner().invoke(app, ["status", "--vllm", str(site)])
    assert result.exit_code == 2
    assert "internal error: RuntimeError: a bug in a patch" in result.output


@pytest.mark.wheel
def test_rewrite_bug_refuses_that_patch_alone(make_tree, monkeypatch):
    """A patch whose rewrite does not compile is k3patch's bug: exit 2, named on stdout and in
    one stderr line; nothing of it is written, the other pending patch is,
    and with --all-or-nothing nothing at all."""
    site = make_tree("0.31.0")
    patch = next(p for p in all_patches() if p.id == "aiter-mla-gfx942")
    original = type(patch).rewrite

    def rewrite(self, sources, pending, files):
        original(self, sources, pending, files)
        files["_aiter_ops.py"].append_definition("return 1\n")  # parses; compile() refuses it

    monkeypatch.setattr(type(patch), "rewrite", rewrite)
    before = tree_hashes(site)
    result = CliRunner().invoke(app, ["apply", "--vllm", str(site), "--all-or-nothing"])
    assert result.exit_code == 2, result.output
    assert (
        "aiter-mla-gfx942 (a k3patch bug" in result.stdout and "does not compile" in result.stdout
    )
    assert "nothing was written (--all-or-nothing)" in result.stdout
    assert tree_hashes(site) == before

    result = CliRunner().invoke(app, ["apply", "--vllm", str(site), "--json"])
    assert result.exit_code == 2, result.output
    data = json.loads(result.stdout)
    assert data["exit_code"] == 2 and list(data["bugs"]) == ["aiter-mla-gfx942"]
    assert "does not compile" in data["bugs"]["aiter-mla-gfx942"]
    assert data["written"] == [
        "vllm/distributed/kv_transfer/kv_connector/v1/moriio/moriio_connector.py"
    ]
    (line,) = result.stderr.splitlines()
    assert line.startswith("k3patch: error: internal error (a k3patch bug)") and "aiter" in line
    after = tree_hashes(site)
    changed = {rel for rel in after if after[rel] != before.get(rel)}
    assert "vllm/_aiter_ops.py" not in changed and "vllm/platforms/rocm.py" not in changed
    assert any(rel.endswith("moriio_connector.py") for rel in changed)


@pytest.mark.wheel
def test_status_digest_matches_json_and_changes_with_a_byte(make_tree):
    a, b = make_tree("0.31.0"), make_tree("0.31.0")
    da = run_cli("status", "--vllm", str(a), "--digest").stdout.strip()
    db = run_cli("status", "--vllm", str(b), "--digest").stdout.strip()
    assert da == db and len(da) == 16
    assert json.loads(run_cli("status", "--vllm", str(a), "--json").stdout)["digest"] == da
    target = b / "vllm" / "_aiter_ops.py"
    target.write_bytes(target.read_bytes() + b"\n")
    assert run_cli("status", "--vllm", str(b), "--digest").stdout.strip() != da


@pytest.mark.wheel
def test_human_output_keeps_long_paths_whole(make_tree, tmp_path):
    deep = tmp_path / ("a-very-long-directory-name-" * 4) / "site-packages"
    deep.parent.mkdir(parents=True)
    os.rename(make_tree("0.31.0"), deep)
    proc = run_cli("status", "--vllm", str(deep), env={"COLUMNS": "60"})
    assert str(deep / "vllm") in proc.stdout
    assert "\x1b[" not in proc.stdout  # NO_COLOR (set by run_cli) is honoured


@pytest.mark.slow  # a wheel build
def test_installed_wheel_carries_patches(tmp_path, k3patch_source):
    """`pip install .` into a fresh venv, then `k3patch list` from another directory."""
    root = k3patch_source
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "--quiet", str(root)]
    subprocess.run(pip, check=True, cwd=tmp_path)
    site = next((venv / "lib").glob("python*/site-packages"))
    for folder_patch in (
        "aiter_mla_gfx942",
        "kda_gather_diagnostic",
        "moriio_chunk_gate",
        "moriio_group_routing",
    ):
        for name in ("__init__.py", "probe.py"):
            assert (site / "k3patch" / "patches" / folder_patch / name).is_file()
    # Exactly the checkout's patch sources: nothing stale (a deleted module) is shipped.
    shipped = site / "k3patch" / "patches"
    checkout = Path(__file__).resolve().parent.parent / "patches"

    def sources(top: Path) -> set[str]:
        return {str(p.relative_to(top)) for p in top.rglob("*.py") if "__pycache__" not in p.parts}

    assert sources(shipped) == sources(checkout)
    assert not (site / "patches").exists(), "a top-level `patches` package was installed"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run(
        [str(venv / "bin" / "k3patch"), "list", "--json"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr
    assert "aiter-mla-gfx942" in {p["id"] for p in json.loads(proc.stdout)["patches"]}


def _run_in_tty(args: list[str], env: dict[str, str]) -> str:
    """Run the CLI with its stdout on a pseudo-terminal; returns what it printed."""
    import pty

    output = bytearray()

    def read(fd: int) -> bytes:
        data = os.read(fd, 65536)
        output.extend(data)
        return data

    saved = dict(os.environ)
    os.environ.clear()
    os.environ.update(env)
    try:
        pty.spawn([sys.executable, "-m", "k3patch", *args], read)
    finally:
        os.environ.clear()
        os.environ.update(saved)
    return output.decode(errors="replace")


@pytest.mark.wheel
def test_no_color_is_honoured_on_a_terminal(make_tree):
    site = make_tree("0.31.0")
    base = {k: v for k, v in os.environ.items() if k not in ("NO_COLOR", "FORCE_COLOR")}
    base["TERM"] = "xterm-256color"
    coloured = _run_in_tty(["status", "--vllm", str(site)], base)
    plain = _run_in_tty(["status", "--vllm", str(site)], {**base, "NO_COLOR": "1"})
    assert "\x1b[" in coloured, "a terminal without NO_COLOR should get colour"
    assert "pending" in plain and "\x1b[3" not in plain and "\x1b[1;3" not in plain


def test_shell_completion_installs(tmp_path):
    proc = run_cli("--install-completion", "bash", env={"HOME": str(tmp_path)})
    assert proc.returncode == 0, proc.stderr
    script = tmp_path / ".bash_completions" / "k3patch.sh"
    assert "_k3patch_completion" in script.read_text()


def test_a_command_that_did_not_run_is_never_success(monkeypatch):
    """The exit code is the one the command's body recorded. A library that takes the call
    before the body runs (typer 0.12.5 under click 8.3 ran an eager --version callback in place
    of every command, and k3patch exited 0 having done nothing) makes it an internal error."""
    import typer

    monkeypatch.setattr(typer.core.TyperGroup, "invoke", lambda self, ctx: 0)
    result = CliRunner().invoke(app, ["apply", "--quiet", "--vllm", "/nonexistent/k3patch"])
    assert result.exit_code == 2, result.output
    (line,) = result.stderr.splitlines()
    assert line.startswith("k3patch: error: internal error: the apply command did not run")
    # Help and --version still end as they should: nothing was asked to run.
    assert CliRunner().invoke(app, ["apply", "--help"]).exit_code == 0
    assert CliRunner().invoke(app, ["apply", "-h"]).exit_code == 0
    version = CliRunner().invoke(app, ["--version"])
    assert version.exit_code == 0 and version.stdout.startswith("k3patch ")


COMMANDS = ["list", "status", "apply", "revert", "verify"]


@pytest.mark.parametrize("command", ["", *COMMANDS])
def test_dash_h_is_help(command):
    """Issue 29 item 5: `-h` as well as `--help`, on every command."""
    args = [command] if command else []
    short, long = run_cli(*args, "-h"), run_cli(*args, "--help")
    assert short.returncode == long.returncode == 0, short.stderr
    assert short.stdout == long.stdout and short.stdout.startswith("Usage: k3patch")
    assert not short.stderr


@pytest.mark.parametrize(
    "args, words",
    [
        (["bogus"], ["no command 'bogus'", *COMMANDS]),  # not "see `k3patch bogus --help`"
        ([], ["give a command", *COMMANDS]),  # bare `k3patch`: a usage error like any other
        (["--version", "apply"], ["--version takes nothing after it"]),  # never "apply ran"
        (["--version", "--help"], ["--version takes nothing after it"]),
    ],
)
def test_a_missing_or_unknown_command_is_one_usage_line(args, words):
    proc = run_cli(*args)
    assert proc.returncode == 2 and not proc.stdout, proc.stdout
    (line,) = proc.stderr.splitlines()
    assert line.startswith("k3patch: error: ") and "bogus --help" not in line, line
    assert all(word in line for word in words), line


@pytest.mark.wheel
def test_two_output_forms_are_a_usage_error(make_tree):
    """Issue 29 item 5: two options that each choose what is printed were one silently
    dropped. Now a usage error, on the no-op path (an applied tree) as on the full one;
    --json with --diff or --sites (the object carries both) and apply's --diff beside its
    report stay."""
    site = make_tree("0.31.0")
    assert run_cli("apply", "--quiet", "--vllm", str(site)).returncode == 0
    forms = {
        "status": ["--json", "--quiet", "--digest", "--sites", "--diff"],
        "apply": ["--json", "--quiet", "--sites"],
    }
    both = {("status", "--json", "--diff"), ("apply", "--json", "--diff")}
    both |= {("status", "--json", "--sites"), ("apply", "--json", "--sites")}
    both |= {("apply", "--quiet", "--diff"), ("apply", "--sites", "--diff")}
    for command, options in forms.items():
        for i, first in enumerate(options):
            for second in options[i + 1 :]:
                if (command, first, second) in both:
                    continue
                args = [command, first, second, "--vllm", str(site)]
                for env in ({}, {"K3PATCH_NO_FASTPATH": "1"}):
                    proc = run_cli(*args, env=env)
                    assert proc.returncode == 2, (args, env, proc.stdout)
                    (line,) = proc.stderr.splitlines()
                    assert f"{first} and {second} choose two different outputs" in line, line
    for command, first, second in both:
        proc = run_cli(command, first, second, "--vllm", str(site))
        assert proc.returncode == 0, (command, first, second, proc.stderr)


@pytest.mark.wheel
@pytest.mark.parametrize("applied_first", [False, True], ids=["pending", "applied"])
def test_a_patch_both_selected_and_skipped_is_a_usage_error_on_every_command(
    make_tree, applied_first
):
    """A patch named by both `--only` and `--skip` is a usage error (exit 2, one line on
    stderr, nothing written) on every command, the no-op path of an applied tree included:
    never "nothing selected, nothing to do" (exit 0) on one command and "nothing to verify"
    (exit 3) on another."""
    site = make_tree("0.31.0")
    if applied_first:
        assert run_cli("apply", "--vllm", str(site), "-q").returncode == 0
    before = tree_hashes(site)
    pick = ["--only", "aiter-mla-gfx942", "--skip", "aiter-mla-gfx942"]
    for command in ("status", "apply", "verify"):
        proc = run_cli(command, "--vllm", str(site), *pick)
        assert proc.returncode == 2, (command, proc.stdout, proc.stderr)
        assert len(proc.stderr.splitlines()) == 1, (command, proc.stderr)
        assert "--only and --skip both name 'aiter-mla-gfx942'" in proc.stderr
        assert tree_hashes(site) == before, command


@pytest.mark.parametrize("name", ["vllm", "vllm-0.31.0"])
def test_a_symlinked_package_dir_is_refused_with_advice_that_holds(make_tree, tmp_path, name):
    """`vllm/` a link to the real package dir (Nix- or Bazel-style installs name that dir as
    they like): a symlinked tree is refused (exit 2), and the line names the link and its
    target and says what to pass. Following that advice must work: `--vllm TARGET` for a target
    not named vllm was refused in turn as having "no vllm/__init__.py", with the file there."""
    site = make_tree("0.31.0")
    real = tmp_path / "store" / name
    real.parent.mkdir()
    (site / "vllm").rename(real)
    (site / "vllm").symlink_to(real)
    before = tree_hashes(real)
    proc = run_cli("status", "--vllm", str(site))
    assert proc.returncode == 2 and len(proc.stderr.splitlines()) == 1, proc.stderr
    assert f"{site / 'vllm'} is a symlink to {real}" in proc.stderr
    direct = run_cli("status", "--vllm", str(real))
    if name == "vllm":
        assert f"pass --vllm {real}" in proc.stderr and direct.returncode == 1
    else:
        assert "--vllm" not in proc.stderr and "rename it vllm" in proc.stderr
        assert direct.returncode == 2 and "no vllm/__init__.py" not in direct.stderr
        assert "not named vllm" in direct.stderr, direct.stderr
        real.rename(real.parent / "vllm")  # as the line says: then it is a package dir
        assert run_cli("status", "--vllm", str(real.parent / "vllm")).returncode == 1
        real = real.parent / "vllm"
    assert tree_hashes(real) == before
