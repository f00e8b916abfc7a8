"""k3patch installed beside the dependency versions pip may give it, and on the Pythons vLLM
images run: a fresh venv per case, k3patch installed from a built wheel (not editable), and the
CLI cycle on a real pending vLLM tree through the console script.

Cases: (a) the lowest version pyproject.toml allows for every dependency, with the newest click
and with the lowest click that lowest typer allows, (b) the newest (a plain resolve), (c) typer
0.12.5 with click 8.3, which pip must refuse (pyproject.toml says why), and the same install
forced with --no-deps, which must refuse in one line; and the newest on every other Python here
(pyenv).

The venvs are cached under ~/.cache/k3patch/envs, keyed by the interpreter and the resolved
versions; only k3patch itself is reinstalled in each run. The verify probes need torch, which
here exists for Python 3.11 only: on the other interpreters the cycle and the plugin's import run.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import tomllib
from conftest import CACHE, ROOT, tree_hashes
from packaging.requirements import Requirement
from packaging.version import Version

pytestmark = [pytest.mark.slow, pytest.mark.wheel]

ENVS = CACHE.parent / "envs"
PYENV = Path("/root/.pyenv/versions")
OTHER_PYTHONS = ["3.10.13", "3.12.1", "3.13.0"]
CLICK_8_3 = "8.3.1"


def lower_bounds() -> dict[str, str]:
    """Each dependency's `>=` bound, as pyproject.toml declares it."""
    with open(ROOT / "pyproject.toml", "rb") as handle:
        project = tomllib.load(handle)["project"]
    bounds = {}
    for line in project["dependencies"]:
        req = Requirement(line)
        (lower,) = [s.version for s in req.specifier if s.operator == ">="]
        bounds[req.name] = lower
    return bounds


@pytest.fixture(scope="session")
def k3patch_wheel(tmp_path_factory, k3patch_source) -> Path:
    out = tmp_path_factory.mktemp("k3patch-wheel")
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(out), k3patch_source],
        check=True,
    )
    (wheel,) = out.glob("k3patch-*.whl")
    return wheel


def _pip(python: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [python, "-m", "pip", "--disable-pip-version-check", *args],
        capture_output=True,
        text=True,
    )


def resolve(python: str, wheel: Path, constraints: list[str], tmp: Path):
    """What pip installs for k3patch on `python` under `constraints`: {name: version}, or the
    failed pip run."""
    cons = tmp / "constraints.txt"
    cons.write_text("".join(f"{c}\n" for c in constraints))
    report = tmp / "report.json"
    proc = _pip(
        python,
        *("install", "--quiet", "--dry-run", "--ignore-installed", "--report", str(report)),
        *("-c", str(cons), str(wheel)),
    )
    if proc.returncode != 0:
        return proc
    found = json.loads(report.read_text())["install"]
    return {
        i["metadata"]["name"].lower(): i["metadata"]["version"]
        for i in found
        if i["metadata"]["name"].lower() != "k3patch"
    }


def venv_with(python: str, versions: dict[str, str], wheel: Path) -> Path:
    """A venv of `python` holding exactly `versions` (cached) and this k3patch (reinstalled)."""
    version = subprocess.run(
        [python, "-c", "import sys; print(sys.version)"], capture_output=True, text=True
    ).stdout
    pins = sorted(f"{n}=={v}" for n, v in versions.items())
    key = hashlib.sha256("\n".join([version, *pins]).encode()).hexdigest()[:16]
    venv = ENVS / key
    ENVS.mkdir(parents=True, exist_ok=True)
    with open(ENVS / f"{key}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (venv / ".complete").exists():
            shutil.rmtree(venv, ignore_errors=True)
            subprocess.run([python, "-m", "venv", str(venv)], check=True)
            proc = _pip(str(venv / "bin" / "python"), "install", "--quiet", "--no-deps", *pins)
            assert proc.returncode == 0, proc.stderr[-3000:]
            (venv / ".complete").write_text("\n".join(pins) + "\n")
        os.utime(venv / ".complete")  # used now: see _prune
        # Reinstalled only when this k3patch differs from the one there: a forced reinstall under
        # another worker's running CLI made it fail (a half-installed package). Each xdist worker
        # builds its own wheel, so the mark is its RECORD (every member's hash), not its bytes.
        with zipfile.ZipFile(wheel) as whl:
            (record,) = [n for n in whl.namelist() if n.endswith(".dist-info/RECORD")]
            mark = hashlib.sha256(whl.read(record)).hexdigest()
        installed = venv / ".k3patch-record"
        if not installed.exists() or installed.read_text() != mark:
            proc = _pip(
                str(venv / "bin" / "python"),
                *("install", "--quiet", "--no-deps", "--force-reinstall", str(wheel)),
            )
            assert proc.returncode == 0, proc.stderr[-3000:]
            installed.write_text(mark)
    _prune()
    return venv


def _prune(days: float = 14) -> None:
    """Venvs no run used for `days` go: a new release makes a new newest venv (about 60 MB)."""
    import time

    def stale(marker: Path) -> bool:
        try:
            return time.time() - marker.stat().st_mtime > days * 86400
        except FileNotFoundError:  # another run pruned it
            return False

    for marker in ENVS.glob("*/.complete"):
        if stale(marker):
            with open(ENVS / f"{marker.parent.name}.lock", "w") as lock:
                fcntl.flock(lock, fcntl.LOCK_EX)
                if stale(marker):
                    shutil.rmtree(marker.parent, ignore_errors=True)


def run(venv: Path, *args: str, cwd: Path, fast: bool = False) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "K3PATCH_NO_FASTPATH")}
    env["NO_COLOR"] = "1"
    if not fast:
        env["K3PATCH_NO_FASTPATH"] = "1"  # the CLI stack under test parses every command
    return subprocess.run(
        [str(venv / "bin" / "k3patch"), *args], capture_output=True, text=True, cwd=cwd, env=env
    )


def first_line(proc: subprocess.CompletedProcess) -> str:
    lines = (proc.stdout.strip() or proc.stderr.strip()).splitlines()
    return lines[0] if lines else ""


def cycle(venv: Path, make_tree, tmp: Path) -> list[tuple[str, int, str]]:
    """The CLI cycle on real pending 0.31.0 trees; every step asserted. Returns (command, exit
    code, first output line) of each step, printed for the record."""
    from k3patch import __version__

    seen = []

    def step(*args: str, fast: bool = False) -> subprocess.CompletedProcess:
        proc = run(venv, *args, cwd=tmp, fast=fast)
        shown = " ".join(a if not a.startswith("/") else Path(a).name for a in args)
        seen.append((shown, proc.returncode, first_line(proc)))
        return proc

    site = make_tree("0.31.0")
    before = tree_hashes(site)
    proc = step("status", "--vllm", str(site))
    assert proc.returncode == 1 and "pending" in proc.stdout, seen
    proc = step("apply", "--vllm", str(site))
    assert proc.returncode == 0 and tree_hashes(site) != before, seen
    proc = step("status", "--vllm", str(site))
    assert proc.returncode == 0 and "applied" in proc.stdout, seen
    proc = step("status", "--vllm", str(site), "--json")
    assert proc.returncode == 0 and json.loads(proc.stdout)["exit_code"] == 0, seen
    proc = step("revert", "--vllm", str(site))
    assert proc.returncode == 0, seen
    after = {k: v for k, v in tree_hashes(site).items() if not k.startswith("vllm/.k3patch/")}
    assert after == before, "revert is not byte-exact"
    for args in (["--bogus"], ["status", "--bogus"]):
        proc = step(*args)
        assert proc.returncode == 2 and not proc.stdout, seen
        (line,) = proc.stderr.splitlines()
        assert line.startswith("k3patch: error: ") and "--bogus" in line, seen
    # The entrypoint's form, on the path it takes: the work is done, not skipped.
    pending = make_tree("0.31.0")
    proc = step("apply", "--quiet", "--vllm", str(pending), fast=True)
    assert proc.returncode == 0 and "aiter-mla-gfx942: applied" in proc.stdout, seen
    assert "envs.is_set" in (pending / "vllm" / "_aiter_ops.py").read_text()
    proc = step("status", "--quiet", "--vllm", str(pending), fast=True)
    assert proc.returncode == 0, seen
    proc = step("--version")
    assert proc.returncode == 0 and proc.stdout == f"k3patch {__version__}\n", seen
    # Every command's help, both spellings (typer 0.15 with click 8.2+ failed on all but list's);
    # the commands are read from the top-level help, so a new one is covered too.
    for flag in ("--help", "-h"):
        proc = step(flag)
        assert proc.returncode == 0 and proc.stdout.startswith("Usage: k3patch "), seen
        assert not proc.stderr, seen
    listed = proc.stdout.split("\nCommands:\n")[1].splitlines()
    commands = [line.split()[0] for line in listed if line.startswith("  ") and line.split()]
    assert {"list", "status", "apply", "revert", "verify"} <= set(commands), proc.stdout
    for command in commands:
        for flag in ("--help", "-h"):
            proc = step(command, flag)
            assert proc.returncode == 0 and not proc.stderr, seen
            assert proc.stdout.startswith(f"Usage: k3patch {command} "), seen
            if command != "list":
                assert "--vllm PATH" in proc.stdout, seen
    # The vLLM plugin is found through its entry point and imports on this interpreter.
    plugin = subprocess.run(
        [str(venv / "bin" / "python"), "-c", _PLUGIN_CHECK], capture_output=True, text=True
    )
    assert plugin.returncode == 0 and plugin.stdout.strip() == "k3patch.plugin", plugin.stderr
    for row in seen:
        print(" | ".join(map(str, row)))
    return seen


_PLUGIN_CHECK = """
from importlib.metadata import entry_points
(ep,) = [e for e in entry_points(group="vllm.general_plugins") if e.name == "k3patch_preflight"]
print(ep.load().__module__)
"""


def _case(python: str, constraints: list[str], wheel: Path, tmp: Path) -> Path:
    versions = resolve(python, wheel, constraints, tmp)
    assert isinstance(versions, dict), versions.stderr[-3000:]
    print(python, " ".join(f"{n}=={v}" for n, v in sorted(versions.items())))
    return venv_with(python, versions, wheel)


def test_lowest_bounds(make_tree, tmp_path, k3patch_wheel):
    bounds = lower_bounds()
    constraints = [f"{name}=={version}" for name, version in bounds.items()]
    versions = resolve(sys.executable, k3patch_wheel, constraints, tmp_path)
    assert isinstance(versions, dict), versions.stderr[-3000:]
    for name, version in bounds.items():
        assert Version(versions[name]) == Version(version), name
    # With the newest click pip gives them (typer 0.15's --help failed under click 8.2+)...
    venv = venv_with(sys.executable, versions, k3patch_wheel)
    print(" ".join(f"{n}=={v}" for n, v in sorted(versions.items())))
    cycle(venv, make_tree, tmp_path)
    # ...and with typer's own lowest click, read from that typer's metadata in the venv.
    requires = subprocess.run(
        [
            str(venv / "bin" / "python"),
            "-c",
            "import importlib.metadata as m; print('\\n'.join(m.requires('typer')))",
        ],
        capture_output=True,
        text=True,
    ).stdout
    (click_low,) = re.findall(r"^click>=([\w.]+)", requires, re.M)
    versions = resolve(
        sys.executable, k3patch_wheel, [*constraints, f"click=={click_low}"], tmp_path
    )
    assert isinstance(versions, dict), versions.stderr[-3000:]
    print(" ".join(f"{n}=={v}" for n, v in sorted(versions.items())))
    cycle(venv_with(sys.executable, versions, k3patch_wheel), make_tree, tmp_path)


def test_newest(make_tree, tmp_path, k3patch_wheel, k3patch_source):
    venv = _case(sys.executable, [], k3patch_wheel, tmp_path)
    cycle(venv, make_tree, tmp_path)
    # Another worker's build of the same source (other wheel bytes) leaves the venv's k3patch as
    # it is: a CLI running there is never under a reinstall.
    out = tmp_path / "rebuilt"
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(out), k3patch_source],
        check=True,
    )
    (rebuilt,) = out.glob("k3patch-*.whl")
    (cli,) = venv.glob("lib/python*/site-packages/k3patch/cli.py")
    before = cli.stat()
    assert venv_with(sys.executable, _resolved_versions(venv), rebuilt) == venv
    after = cli.stat()
    assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)


def test_typer_0_12_5_with_click_8_3(make_tree, tmp_path, k3patch_wheel):
    """pip refuses the pair for k3patch; forced in with --no-deps, every command that needs
    typer says so in one line and exits 3 (it once exited 0 having done nothing)."""
    pair = ["typer==0.12.5", f"click=={CLICK_8_3}"]
    refused = resolve(sys.executable, k3patch_wheel, pair, tmp_path)
    assert not isinstance(refused, dict), refused
    assert "typer" in refused.stderr
    versions = _case(sys.executable, [], k3patch_wheel, tmp_path)  # newest, for the rest
    forced = {**_resolved_versions(versions), "typer": "0.12.5", "click": CLICK_8_3}
    venv = venv_with(sys.executable, forced, k3patch_wheel)
    site = make_tree("0.31.0")
    before = tree_hashes(site)
    for args in (
        ["status", "--vllm", str(site)],
        ["apply", "--vllm", str(site)],
        ["apply", "--quiet", "--vllm", str(site)],
        ["--bogus"],
        ["list"],
    ):
        proc = run(venv, *args, cwd=tmp_path)
        print(" ".join(args[:2]), proc.returncode, first_line(proc))
        assert proc.returncode == 3 and not proc.stdout, proc
        (line,) = proc.stderr.splitlines()
        assert "typer 0.12.5 with click 8.3" in line
        assert f"typer>={lower_bounds()['typer']}" in line
    assert tree_hashes(site) == before
    proc = run(venv, "--version", cwd=tmp_path)
    assert proc.returncode == 0 and proc.stdout.startswith("k3patch ")


def _resolved_versions(venv: Path) -> dict[str, str]:
    pins = (venv / ".complete").read_text().split()
    return dict(p.split("==") for p in pins)


@pytest.mark.parametrize("version", OTHER_PYTHONS)
def test_other_pythons(make_tree, tmp_path, k3patch_wheel, version):
    python = PYENV / version / "bin" / "python3"
    if not python.exists():
        pytest.skip(f"{python} is not installed here")
    cycle(_case(str(python), [], k3patch_wheel, tmp_path), make_tree, tmp_path)


def test_both_entry_points_find_the_same_tree(make_tree, tmp_path):
    """Without --vllm, `python -m k3patch` and the console script find the vLLM that `vllm
    serve` would import (here: the one on PYTHONPATH), not a vllm/ in the current directory."""
    site = make_tree("0.31.0")
    elsewhere = tmp_path / "build-context"
    shutil.copytree(make_tree("0.31.0") / "vllm", elsewhere / "vllm")
    script = Path(sys.executable).parent / "k3patch"
    env = {**os.environ, "PYTHONPATH": str(site), "NO_COLOR": "1"}
    entry_points = {"-m": [sys.executable, "-m", "k3patch"], "script": [str(script)]}

    def status(code: int) -> dict[str, str]:
        seen = {}
        for name, argv in entry_points.items():
            proc = subprocess.run(
                [*argv, "status", "--json"], capture_output=True, text=True, cwd=elsewhere, env=env
            )
            assert proc.returncode == code, proc.stderr
            seen[name] = json.loads(proc.stdout)["vllm"]["package_dir"]
        return seen

    assert status(1) == {"-m": str(site / "vllm"), "script": str(site / "vllm")}
    # Applied, the no-op path answers from the state record: it finds the same tree.
    apply = subprocess.run(entry_points["script"] + ["apply"], cwd=elsewhere, env=env)
    assert apply.returncode == 0
    assert status(0) == {"-m": str(site / "vllm"), "script": str(site / "vllm")}
    assert not (elsewhere / "vllm" / ".k3patch").exists()


def test_every_command_has_help_on_the_lowest_typer_with_the_newest_click(tmp_path):
    """The lowest typer pyproject.toml allows, beside the newest click pip gives it: every
    `COMMAND --help` prints the command's help (typer 0.15.1 under click 8.2+ failed on all but
    list's, an internal error, exit 2)."""
    root = Path(__file__).resolve().parents[1]
    lowest = lower_bounds()["typer"]
    dist = tmp_path / "dist"
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(dist), str(root)],
        check=True,
    )
    (wheel,) = dist.glob("k3patch-*.whl")
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    subprocess.run(
        [str(venv / "bin" / "pip"), "install", "-q", str(wheel), f"typer=={lowest}", "click>=8.2"],
        check=True,
    )
    bad = {}
    for command in ("status", "apply", "revert", "verify"):
        proc = subprocess.run(
            [str(venv / "bin" / "k3patch"), command, "--help"], capture_output=True, text=True
        )
        if proc.returncode != 0 or "--vllm" not in proc.stdout:
            bad[command] = (proc.returncode, proc.stderr.strip())
    assert not bad, bad
