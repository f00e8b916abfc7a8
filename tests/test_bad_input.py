"""Bad input and a hostile environment: each case gets a one-line message naming the file and
what to do, its documented exit code, and not one byte changed anywhere."""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from conftest import run_cli, tree_hashes

pytestmark = pytest.mark.wheel
ROOT_ONLY = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to mount or switch user")


def everything(root: Path) -> dict[str, str]:
    """Hashes of every file plus the set of directories: nothing may appear or vanish."""
    out = tree_hashes(root)
    out.update({f"{p.relative_to(root)}/": "dir" for p in root.rglob("*") if p.is_dir()})
    return out


def one_line(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    assert len(lines) == 1, text
    return lines[0]


def record_of(text: str, prefix: str) -> str:
    """The one report line that starts with `prefix`, its wrapped continuation lines (indented,
    at most 100 columns in a log) joined back; there must be exactly one."""
    records: list[str] = []
    for line in text.splitlines():
        assert len(line) <= 100, line
        if line.startswith(" ") and records:
            records[-1] += " " + line.strip()
        else:
            records.append(line)
    found = [r for r in records if r.startswith(prefix)]
    assert len(found) == 1, text
    return found[0]


@pytest.mark.parametrize(
    "junk, expect",
    [
        (b"def broken(:\n", "does not parse"),
        (b"\x00\x01\x02\xff\xfe binary", "not UTF-8"),
        (b"x = '\xe9t\xe9'\n", "not UTF-8"),
        (b"", "holds no code"),
        (b"x = " + b"-" * 100_000 + b"1\n", "too deeply"),
    ],
)
def test_unreadable_target_is_drift_and_untouched(make_tree, junk, expect):
    site = make_tree("0.31.0")
    (site / "vllm" / "_aiter_ops.py").write_bytes(junk)
    before = everything(site)
    proc = run_cli("apply", "--vllm", str(site), "--quiet", "--only", "aiter-mla-gfx942")
    assert proc.returncode == 1
    line = record_of(proc.stdout, "k3patch: aiter-mla-gfx942: drifted")
    assert "vllm/_aiter_ops.py" in line and expect in line and "restore it from the wheel" in line
    assert everything(site) == before


def run_as_nobody(args: list[str]) -> tuple[int, str, str]:
    """Run the CLI in a forked child that dropped to the `nobody` user. Everything it needs is
    imported before the fork, so the child reads no file of the checkout or the venv (which
    may not be readable by `nobody`), only the tree under test."""
    import importlib
    import pkgutil

    import k3patch
    from k3patch.__main__ import main
    from k3patch.registry import all_patches

    for info in pkgutil.iter_modules(k3patch.__path__):
        importlib.import_module(f"k3patch.{info.name}")
    all_patches()
    # typer and rich import parts of themselves on first use: use them once here, on a path
    # that does not exist (so nothing is written), with the same options.
    from typer.testing import CliRunner

    missing = ["--vllm", "/nonexistent/k3patch-warm-up"]
    for warm in ([args[0], *missing], [args[0], "--quiet", *missing], [args[0], "--help"]):
        CliRunner().invoke(k3patch.cli.app, warm)
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child
        code = 99
        try:
            os.close(out_r)
            os.close(err_r)
            sys.stdout = open(out_w, "w")
            sys.stderr = open(err_w, "w")
            os.environ["NO_COLOR"] = "1"
            os.setgroups([])
            os.setgid(65534)
            os.setuid(65534)
            sys.argv = ["k3patch", *args]
            try:
                main()
                code = 0
            except SystemExit as exc:
                code = exc.code if isinstance(exc.code, int) else 1
        except BaseException:
            import traceback

            traceback.print_exc()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    os.close(out_w)
    os.close(err_w)
    with open(out_r) as out, open(err_r) as err:
        stdout, stderr = out.read(), err.read()
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status), stdout, stderr


@contextmanager
def shared_site(make_tree: Callable[..., Path]) -> Iterator[Path]:
    """A 0.31.0 tree in a directory every user may enter (pytest's own temp dirs are root's
    0700), for the tests that run k3patch as `nobody`."""
    shared = Path(tempfile.mkdtemp(prefix="k3patch-perm-", dir="/tmp"))
    try:
        os.chmod(shared, 0o755)
        site = shared / "site"
        shutil.copytree(make_tree("0.31.0"), site)
        yield site
    finally:
        shutil.rmtree(shared)
