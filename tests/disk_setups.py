"""The set-ups the "trust nothing on disk" tests share, each in one place: what a tree holds
(`everything`, `source_hashes`, its record), another user (`shared_site`, `as_nobody`,
`run_as_nobody`), FIFOs and a bound on anything that could block on one, an upgrade over a tree,
a run killed or paused at a chosen step, the plugin run as vLLM would start it, and the one-line
checks on what k3patch printed."""

from __future__ import annotations

import base64
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
import threading
import zipfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import crash_campaign
import pytest
from conftest import pristine_tree, run_cli, sha, tree_hashes, vllm_wheel

from k3patch.state import STATE_FILE, registered_targets

ROOT_ONLY = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (mount, chown, setuid)")
AITER = "_aiter_ops.py"
CONNECTOR = "distributed/kv_transfer/kv_connector/v1/moriio/moriio_connector.py"
# The same files relative to the site-packages dir (the tree's root).
AITER_FILE, CONNECTOR_FILE = f"vllm/{AITER}", f"vllm/{CONNECTOR}"
# moriio-group-routing's two files on fork tree "a", relative to the site-packages dir.
GROUP_ROUTING = [
    "vllm/distributed/kv_transfer/kv_connector/v1/moriio/moriio_common.py",
    "vllm/distributed/kv_transfer/kv_connector/v1/moriio/moriio_engine.py",
]
BOUND = 60.0  # seconds: a guard against a hang, not a measurement


# -- what a tree holds -------------------------------------------------------------------------


def digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def everything(root: Path) -> dict[str, str]:
    """Every file's hash and every directory: nothing may appear, vanish or change."""
    out = tree_hashes(root)
    out.update({f"{p.relative_to(root)}/": "dir" for p in root.rglob("*") if p.is_dir()})
    return out


def source_hashes(site: Path) -> dict[str, str]:
    """tree_hashes without k3patch's own state dir."""
    return {k: v for k, v in tree_hashes(site).items() if "/.k3patch/" not in k}


def record(site: Path) -> dict:
    return json.loads((site / "vllm/.k3patch" / STATE_FILE).read_text())


def write_record(site: Path, data: dict) -> None:
    (site / "vllm/.k3patch" / STATE_FILE).write_text(json.dumps(data))


def record_b64(data: bytes) -> str:
    """A hash as a wheel's RECORD writes it."""
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


def upgrade(site: Path, version: str) -> None:
    """pip install --upgrade (or --force-reinstall) of `version` over the tree."""
    crash_campaign.upgrade(site, pristine_tree(version), sorted(registered_targets()))


# -- what k3patch printed ----------------------------------------------------------------------


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


def bash(command: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", "-c", command], capture_output=True, text=True)


# -- FIFOs, and a bound on what could block on one ----------------------------------------------


def fifo_at(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.exists() or path.is_symlink():
        path.unlink()
    os.mkfifo(path)
    return path


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


class FakeVllm:
    """What the plugin reads of an imported `vllm`: where its package is."""

    def __init__(self, site: Path) -> None:
        self.__file__ = str(site / "vllm" / "__init__.py")


# -- another user ------------------------------------------------------------------------------


@contextmanager
def shared_site(make_tree: Callable[..., Path], version: str = "0.31.0") -> Iterator[Path]:
    """A tree (directories 0755, files 0644) under a directory every user may enter (pytest's
    own temp dirs are root's, 0700), for the tests that run k3patch as `nobody`."""
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


# -- the plugin, as vLLM starts it --------------------------------------------------------------

PREFLIGHT = textwrap.dedent(
    """
    import sys, types
    pkg = sys.argv[1]
    m = types.ModuleType('vllm'); m.__file__ = pkg + '/__init__.py'; m.__path__ = [pkg]
    sys.modules['vllm'] = m
    from k3patch.plugin import preflight
    preflight()
    """
)


def preflight_fail(pkg: Path, env: dict[str, str]) -> subprocess.CompletedProcess:
    """The plugin's preflight with K3PATCH_PREFLIGHT=fail, in a fresh interpreter whose `vllm`
    is the package dir `pkg` (nothing of it imported)."""
    return subprocess.run(
        [sys.executable, "-c", PREFLIGHT, str(pkg)],
        capture_output=True,
        text=True,
        env={**os.environ, **env, "K3PATCH_PREFLIGHT": "fail"},
    )


# -- a run killed or paused at a chosen step ----------------------------------------------------
# Deterministic, never by timing: strace stops or kills a real process at a real syscall of its
# commit, or the commit's own test hook (K3PATCH_TEST_CRASH_AT) kills it at a named step.

STRACE = shutil.which("strace")
needs_strace = pytest.mark.skipif(STRACE is None, reason="strace pauses the run at a syscall")


def k3patch_argv(*args: str) -> list[str]:
    return [sys.executable, "-m", "k3patch", *args]


def apply_killed_at(site: Path, syscall: str, when: int) -> subprocess.CompletedProcess[bytes]:
    """An apply on `site` killed (SIGKILL, by strace) at its `when`-th `syscall`."""
    assert STRACE is not None
    inject = f"inject={syscall}:signal=SIGKILL:when={when}"
    argv = [STRACE, "-f", "-o", "/dev/null", "-e", f"trace={syscall}", "-e", inject]
    return subprocess.run([*argv, *k3patch_argv("apply", "--vllm", str(site))], capture_output=True)


def killed_after_every_file_was_replaced(site: Path) -> dict[str, tuple[str, str]]:
    """An apply killed after all its renames (journal still there). Returns, per file of
    moriio-group-routing, (original hash, patched hash)."""
    before = {rel: sha(site / rel) for rel in GROUP_ROUTING}
    proc = run_cli(
        "apply", "--vllm", str(site), "-q", env={"K3PATCH_TEST_CRASH_AT": "kept-removed"}
    )
    assert proc.returncode == 137, proc.stderr
    assert (site / "vllm/.k3patch/journal.json").exists()
    return {rel: (before[rel], sha(site / rel)) for rel in GROUP_ROUTING}
