"""Trust nothing, round two (issue 21, part B): odd files, odd users, several installs.

Every file k3patch reads in a tree is opened no-follow and non-blocking, and only when it is a
regular file: a FIFO at any of them is exit 3, never a hang (class 1). The version is the
installed one when several dist-infos stand beside the package (4). A record another user
wrote is readable by whoever reads the tree, and one this user may not read is named as such,
never "never applied" (5). The owner can apply where nothing needs a chown (6). A `.k3patch`
that is not usable makes status exit 3, with the verdicts still read from the code (11).

Anything that could block runs bounded: in a thread joined with a timeout (a FIFO left blocking
is opened for writing afterwards, which frees the thread), or in a subprocess with a timeout.
"""

from __future__ import annotations

import base64
import errno
import hashlib
import json
import os
import shutil
import stat
import subprocess
import sys
import tempfile
import threading
import zipfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from conftest import pristine_tree, tree_hashes, vllm_wheel

from k3patch import engine, plugin, scan, state
from k3patch.errors import EnvironmentProblem
from k3patch.tree import locate

pytestmark = pytest.mark.wheel
ROOT_ONLY = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to become nobody")
AITER = "_aiter_ops.py"
CONNECTOR = "distributed/kv_transfer/kv_connector/v1/moriio/moriio_connector.py"
BOUND = 60.0  # seconds: a guard against a hang, not a measurement


def bounded(fn: Callable[[], Any], fifos: list[Path]) -> Any:
    """fn() in a thread; a hang (a blocking open of one of `fifos`) fails the test instead of
    hanging it, and the FIFO is then opened for writing so that the thread is freed."""
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["value"] = fn()
        except BaseException as exc:  # handed to the test below
            box["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(BOUND)
    if thread.is_alive():
        for fifo in fifos:
            try:
                os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
            except OSError:
                pass
        thread.join(5)
        pytest.fail(f"blocked on a FIFO: {fifos}")
    if "error" in box:
        raise box["error"]
    return box.get("value")


def cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "k3patch", *args],
        capture_output=True,
        text=True,
        timeout=BOUND * 2,
        env={**os.environ, "NO_COLOR": "1", **(env or {})},
    )


def fifo_at(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.exists() or path.is_symlink():
        path.unlink()
    os.mkfifo(path)
    return path


def record_b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def add_dist_info(site: Path, version: str, *, record_from: str | None = None) -> Path:
    """A `vllm-VERSION.dist-info` beside the package, METADATA from that wheel; with
    `record_from`, the RECORD of that version's real wheel (what pip writes)."""
    dist = site / f"vllm-{version}.dist-info"
    dist.mkdir(exist_ok=True)
    meta = pristine_tree(version) / f"vllm-{version}.dist-info" / "METADATA"
    shutil.copy2(meta, dist / "METADATA")
    if record_from is not None:
        with zipfile.ZipFile(vllm_wheel(record_from)) as wheel:
            (dist / "RECORD").write_bytes(wheel.read(f"vllm-{record_from}.dist-info/RECORD"))
    return dist


def with_version_py(site: Path, version: str) -> None:
    shutil.copy2(pristine_tree(version) / "vllm" / "_version.py", site / "vllm" / "_version.py")


# -- 1: a FIFO at every file k3patch reads -------------------------------------------------

PYC = f"__pycache__/_aiter_ops.{sys.implementation.cache_tag}.pyc"


def plant(site: Path, where: str) -> Path:
    """The tree prepared for a FIFO at `where`, and the FIFO."""
    pkg = site / "vllm"
    if where == "METADATA":
        return fifo_at(site / "vllm-0.31.0.dist-info" / "METADATA")
    if where == "RECORD":  # several dist-infos: the RECORDs decide, and one is a FIFO
        add_dist_info(site, "0.29.0")
        return fifo_at(site / "vllm-0.29.0.dist-info" / "RECORD")
    if where == "_version.py":  # a checkout: no dist-info, the version from _version.py
        shutil.rmtree(site / "vllm-0.31.0.dist-info")
        return fifo_at(pkg / "_version.py")
    if where == "pyc":
        return fifo_at(pkg / PYC)
    engine.apply(locate(site))  # the record, journal and hashed targets of an applied tree
    if where == "target":
        return fifo_at(pkg / AITER)  # a file apply wrote: revert reads it too
    if where == "record":
        return fifo_at(pkg / ".k3patch" / state.STATE_FILE)
    assert where == "journal"
    return fifo_at(pkg / state.JOURNAL_REL)


WHERE = ["METADATA", "RECORD", "_version.py", "target", "pyc", "record", "journal"]


# -- 4: the installed version decides --------------------------------------------------------


# -- 5: the same verdict for every user ------------------------------------------------------


def as_nobody(fn: Callable[[], Any]) -> Any:
    """fn() in a forked child that dropped to `nobody`; its JSON-able result, or the child's
    exception as ("raised", type name, message)."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.close(read_end)
            os.setgroups([])
            os.setgid(65534)
            os.setuid(65534)
            try:
                result: Any = fn()
            except Exception as exc:
                result = ["raised", type(exc).__name__, str(exc)]
            os.write(write_end, json.dumps(result).encode())
        finally:
            os._exit(0)
    os.close(write_end)
    with os.fdopen(read_end, "rb") as handle:
        data = handle.read()
    os.waitpid(pid, 0)
    return json.loads(data)


@contextmanager
def shared_site(make_tree: Callable[..., Path], version: str = "0.31.0") -> Iterator[Path]:
    """A tree under a directory every user can reach (pytest's tmp dirs are root's, 0700)."""
    top = Path(tempfile.mkdtemp(prefix="k3patch-users-", dir="/tmp"))
    try:
        os.chmod(top, 0o755)
        site = top / "site"
        shutil.copytree(make_tree(version), site)
        for path in [site, *site.rglob("*")]:
            os.chmod(path, 0o755 if path.is_dir() else 0o644)
        yield site
    finally:
        shutil.rmtree(top)


@contextmanager
def umask(mask: int) -> Iterator[None]:
    old = os.umask(mask)
    try:
        yield
    finally:
        os.umask(old)


def status_of(site: Path) -> Callable[[], Any]:
    def run() -> Any:
        report = scan.scan(locate(site))
        verdicts = {k: v.value for k, v in report.verdicts().items()}
        return [report.state_problem, report.from_record, verdicts]

    return run


@ROOT_ONLY
def test_5_an_apply_under_umask_077_leaves_a_record_every_reader_can_read(make_tree):
    with shared_site(make_tree) as site:
        with umask(0o077):
            engine.apply(locate(site))
        state_dir = site / "vllm" / ".k3patch"
        for path in [state_dir, *state_dir.rglob("*")]:
            mode = stat.S_IMODE(os.lstat(path).st_mode)
            assert mode == (0o755 if path.is_dir() else 0o644), (path, oct(mode))
        problem, from_record, verdicts = as_nobody(status_of(site))
        assert problem is None and from_record is True
        assert verdicts["aiter-mla-gfx942"] == "applied"
        assert as_nobody(lambda: plugin.preflight_problem(str(site / "vllm"))) is None


@ROOT_ONLY
@pytest.mark.parametrize("hidden", ["record", "state dir"])
def test_5_a_record_this_user_cannot_read_is_named_never_absent(make_tree, hidden):
    with shared_site(make_tree) as site:
        engine.apply(locate(site))
        state_dir = site / "vllm" / ".k3patch"
        os.chmod(state_dir / state.STATE_FILE if hidden == "record" else state_dir, 0o600)
        problem, from_record, verdicts = as_nobody(status_of(site))
        assert problem is not None and "permission denied" in problem, problem
        assert from_record is False  # the verdicts come from the code
        assert verdicts["aiter-mla-gfx942"] == "applied"
        said = as_nobody(lambda: plugin.preflight_problem(str(site / "vllm")))
        assert said is not None and "cannot be read" in said and "never applied" not in said


# -- 6: the owner can apply -------------------------------------------------------------------


@ROOT_ONLY
def test_6_no_chown_when_the_owner_and_group_are_already_the_files(make_tree, monkeypatch):
    """A setgid directory gives the temp file the target's group already: a chown would be
    refused to an owner outside that group, and is not needed."""
    site = make_tree("0.31.0")
    target = site / "vllm" / AITER
    os.chown(target.parent, -1, 1)
    os.chmod(target.parent, 0o2755)
    os.chown(target, -1, 1)
    assert os.getgid() != 1

    def refuse(fd: int, uid: int, gid: int) -> None:
        raise PermissionError(errno.EPERM, "Operation not permitted")

    monkeypatch.setattr(os, "fchown", refuse)
    engine.apply(locate(site))
    assert os.stat(target).st_gid == 1
    assert scan.scan(locate(site)).verdicts()["aiter-mla-gfx942"].value == "applied"


@ROOT_ONLY
def test_6_a_refused_chown_of_a_file_this_process_does_not_own_names_the_owner(
    make_tree, monkeypatch
):
    """Another user's file: its owner cannot be kept, which is a refusal (a group alone, of a
    file this process owns, is a warning: test_write_path)."""
    site = make_tree("0.31.0")
    target = site / "vllm" / AITER
    os.chown(target, 1234, 1)
    before = tree_hashes(site)

    def refuse(fd: int, uid: int, gid: int) -> None:
        raise PermissionError(errno.EPERM, "Operation not permitted")

    monkeypatch.setattr(os, "fchown", refuse)
    with pytest.raises(EnvironmentProblem) as caught:
        engine.apply(locate(site))
    message = str(caught.value)
    assert "owner 1234" in message, message
    assert "run as the tree's owner" not in message
    assert tree_hashes(site) == before


@ROOT_ONLY
def test_6_the_owner_outside_the_files_group_applies_in_a_setgid_dir(make_tree):
    """For real, as `nobody` owning the tree, the files' group `daemon` (1) not one of its."""
    with shared_site(make_tree) as site:
        for path in [site, *site.rglob("*")]:
            os.chown(path, 65534, 1)
        for path in [p for p in [site, *site.rglob("*")] if p.is_dir()]:
            os.chmod(path, 0o2755)
        result = as_nobody(lambda: engine.apply(locate(site)).written)
        assert result and result[0] != "raised", result
        assert os.stat(site / "vllm" / AITER).st_gid == 1


# -- 11: status says when apply could not run ------------------------------------------------
