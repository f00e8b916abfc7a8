"""Bad input and a hostile environment: each case gets a one-line message naming the file and
what to do, its documented exit code, and not one byte changed anywhere."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from conftest import run_cli, slow_after, tree_hashes

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


@ROOT_ONLY
def test_read_only_filesystem(make_tree, tmp_path):
    mnt = tmp_path / "ro"
    mnt.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", str(mnt)], check=True)
    try:
        shutil.copytree(make_tree("0.31.0"), mnt / "site")
        subprocess.run(["mount", "-o", "remount,ro", str(mnt)], check=True)
        before = everything(mnt)
        proc = run_cli("apply", "--vllm", str(mnt / "site"))
        assert proc.returncode == 3
        line = one_line(proc.stderr)
        assert "read-only" in line and str(mnt / "site" / "vllm") in line
        assert everything(mnt) == before
        # status still works on a read-only tree.
        assert run_cli("status", "--vllm", str(mnt / "site")).returncode == 1
    finally:
        subprocess.run(["umount", str(mnt)], check=False)


@ROOT_ONLY
@pytest.mark.parametrize("headroom_kb", slow_after([40, 200, 330]))
def test_full_disk(make_tree, tmp_path, headroom_kb):
    """A tmpfs just big enough for the tree plus a little: the commit runs out of space at
    different steps (blobs, journal, the new file), and every time nothing is left behind."""
    src = make_tree("0.31.0")
    size_kb = sum(p.stat().st_size for p in src.rglob("*") if p.is_file()) // 1024
    mnt = tmp_path / "full"
    mnt.mkdir()
    subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size_kb + 4096}k", "tmpfs", str(mnt)],
        check=True,
    )
    try:
        shutil.copytree(src, mnt / "site")
        # Fill the rest of the disk, leaving exactly `headroom_kb`.
        free = shutil.disk_usage(mnt).free
        filler = mnt / "filler"
        with open(filler, "wb") as handle:
            handle.write(b"\0" * max(free - headroom_kb * 1024, 0))
        before = everything(mnt / "site")
        proc = run_cli("apply", "--vllm", str(mnt / "site"))
        if proc.returncode == 0:
            pytest.skip(f"{headroom_kb} KiB was enough for the whole commit")
        assert proc.returncode == 3, proc.stderr
        assert "no space left" in one_line(proc.stderr)
        assert everything(mnt / "site") == before
        filler.unlink()
        assert run_cli("apply", "--vllm", str(mnt / "site")).returncode == 0
    finally:
        subprocess.run(["umount", str(mnt)], check=False)


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


@ROOT_ONLY
def test_permission_denied_as_another_user(make_tree):
    with shared_site(make_tree) as site:
        for path in [site, *site.rglob("*")]:
            os.chmod(path, 0o755 if path.is_dir() else 0o644)
        before = everything(site)
        for args in (["apply", "--vllm", str(site)], ["apply", "--quiet", "--vllm", str(site)]):
            code, _, stderr = run_as_nobody(args)
            assert code == 3, stderr
            line = one_line(stderr)
            assert "permission denied" in line and str(site / "vllm") in line
            assert everything(site) == before
        # Reading is allowed: status works for anyone.
        code, stdout, _ = run_as_nobody(["status", "--quiet", "--vllm", str(site)])
        assert code == 1 and "aiter-mla-gfx942: pending" in stdout


@ROOT_ONLY
@pytest.mark.parametrize("hidden", slow_after(["state.json", ".k3patch"]))
def test_a_record_another_user_cannot_read_is_named_by_status(make_tree, hidden):
    """A record left 0600 (an apply under `umask 077` by an older k3patch): `status` as another
    user gives the verdicts from the code, names that it cannot read the record, and exits 3,
    never a silent "no record" (issue 21 items 5, 11)."""
    with shared_site(make_tree) as site:
        for path in [site, *site.rglob("*")]:
            os.chmod(path, 0o755 if path.is_dir() else 0o644)
        assert run_cli("apply", "--vllm", str(site)).returncode == 0
        state_dir = site / "vllm" / ".k3patch"
        os.chmod(state_dir / hidden if hidden == "state.json" else state_dir, 0o600)
        code, stdout, stderr = run_as_nobody(["status", "--quiet", "--vllm", str(site)])
        assert code == 3, (stdout, stderr)
        assert "aiter-mla-gfx942: applied" in stdout
        assert len(stderr.splitlines()) == 1 and "permission denied" in stderr, stderr


@ROOT_ONLY
def test_a_pyc_this_user_cannot_read_is_removed_not_fatal(make_tree):
    """Another user's 0600 pyc in a tree this user may write: apply removes it (the directory
    allows that) and the interpreter compiles the source anew; reading it is not needed."""
    with shared_site(make_tree) as site:
        for path in [site, *site.rglob("*")]:
            os.chown(path, 65534, 65534, follow_symlinks=False)
        cache = site / "vllm" / "__pycache__"
        cache.mkdir()
        os.chown(cache, 65534, 65534)
        pyc = cache / f"_aiter_ops.{sys.implementation.cache_tag}.pyc"
        pyc.write_bytes(b"root's bytecode")
        os.chmod(pyc, 0o600)  # owned by root: nobody cannot read it, but may unlink it
        code, stdout, stderr = run_as_nobody(["apply", "--vllm", str(site)])
        assert code == 0, (stdout, stderr)
        assert f"removed {pyc.name}" in stdout and not pyc.exists()
