"""The example Dockerfiles built by a real dockerd, and the entrypoint started in a container.

No registry is reachable here, so the base is a stand-in vLLM image made from Debian's packages
(debootstrap's bookworm, Python 3.11) with the real vLLM 0.31.0 wheel, CPU torch and vLLM's
pure-Python imports (tests/vllm-import-requirements.txt) installed in /opt/venv, as in a vLLM
image. It is cached in the daemon's data root by a tag keyed on its inputs. Dockerfile.source is
built on the vLLM 0.31.0 sdist (a source checkout) up to its `patched` stage: compiling vLLM needs
the ROCm toolchain (hipcc, ROCm torch), which no image here has.

Skipped when dockerd, docker or debootstrap is not installed (.ci/run installs them), or when
not run as root (dockerd and debootstrap need it).
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import CACHE, vllm_wheel

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"
VERSION = "0.31.0"
# dockerd's data root outlives the run: the stand-in image (minutes to make) is reused.
DATA_ROOT = Path(os.environ.get("K3PATCH_DOCKER_ROOT", CACHE.parent / "docker"))
DAEMON_PID = DATA_ROOT.parent / "dockerd.pid"
DEBIAN_MIRROR = os.environ.get("K3PATCH_DEBIAN_MIRROR", "http://deb.debian.org/debian")
DEBOOTSTRAP = ["--variant=minbase", "--include=python3,python3-venv", "bookworm"]
# The CA file this machine's pip trusts; the stand-in image's pip is given the same.
CA_FILE = Path(os.environ.get("PIP_CERT", "/etc/ssl/certs/ca-certificates.crt"))
SITE = "/opt/venv/lib/python3.11/site-packages"

# One worker takes every test here (with `--dist loadgroup`): the daemon's data root is locked while
# it runs, so a second worker would wait for it, idle.
pytestmark = [pytest.mark.slow, pytest.mark.wheel, pytest.mark.xdist_group("docker")]


def _missing() -> str | None:
    for tool in ("dockerd", "docker", "debootstrap"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed (Debian: apt-get install docker.io debootstrap)"
    if os.geteuid() != 0:
        return "dockerd and debootstrap need root"
    return None


if (_why := _missing()) is not None:
    pytest.skip(_why, allow_module_level=True)


# ------------------------------------------------------------------------------------------
# The daemon.


class Docker:
    """A dockerd started for this module: its own socket and exec root in a temp dir, the
    shared data root (locked while it runs, so two test runs never share a daemon's files)."""

    def __init__(self, sock: Path) -> None:
        self.env = {
            **os.environ,
            "DOCKER_HOST": f"unix://{sock}",
            # The legacy builder: Debian's docker.io has no buildx plugin.
            "DOCKER_BUILDKIT": "0",
            "DOCKER_CONFIG": str(sock.parent / "config"),
        }

    def __call__(self, *args: str, check: bool = True, **kw) -> subprocess.CompletedProcess:
        proc = subprocess.run(["docker", *args], env=self.env, capture_output=True, text=True, **kw)
        if check and proc.returncode != 0:
            pytest.fail(
                f"docker {' '.join(args)}: exit {proc.returncode}\n{proc.stdout}{proc.stderr}"
            )
        return proc

    def has_image(self, tag: str) -> bool:
        return self("image", "inspect", tag, check=False).returncode == 0

    def build(self, dockerfile: Path, context: Path, tag: str, *args: str):
        """`docker build`, timed; returns (CompletedProcess, seconds)."""
        start = time.monotonic()
        proc = self(
            "build", "--network", "host", "--force-rm", "-f", str(dockerfile), "-t", tag,
            *args, str(context), check=False,
        )  # fmt: skip
        return proc, time.monotonic() - start


def _start_dockerd(tmp: Path, driver: str) -> subprocess.Popen | None:
    with open(tmp / f"dockerd-{driver}.log", "w") as log:
        daemon = subprocess.Popen(
            [
                "dockerd",
                "--data-root", str(DATA_ROOT),
                "--exec-root", str(tmp / "exec"),
                "--pidfile", str(tmp / "dockerd.pid"),
                "--host", f"unix://{tmp / 'sock'}",
                "--storage-driver", driver,
                # No bridge, no iptables rules: builds and containers use the host's network or
                # none, and the host's firewall is left as it is.
                "--bridge", "none", "--iptables=false", "--ip6tables=false",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its containerd with it, for the kill below
        )  # fmt: skip
    DAEMON_PID.write_text(f"{daemon.pid}\n")
    docker = Docker(tmp / "sock")
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and daemon.poll() is None:
        if docker("info", check=False).returncode == 0:
            return daemon
        time.sleep(0.5)
    _stop(daemon.pid)
    return None


def _stop(pid: int) -> None:
    """SIGTERM (dockerd stops its containers and containerd), then SIGKILL to its group."""
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        pass
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and _alive(pid):
        time.sleep(0.2)
    if _alive(pid):
        os.killpg(pid, signal.SIGKILL)
    DAEMON_PID.unlink(missing_ok=True)


def _alive(pid: int) -> bool:
    try:
        os.waitpid(pid, os.WNOHANG)  # reap it if it is our child
    except ChildProcessError:
        pass
    try:
        return "dockerd" in Path(f"/proc/{pid}/cmdline").read_text()
    except OSError:
        return False


def _unmount_under(tmp: Path) -> None:
    """What dockerd mounted in its exec root and left there (the default network namespace)."""
    with open("/proc/self/mounts") as mounts:
        points = [line.split()[1] for line in mounts]
    for point in sorted((p for p in points if p.startswith(f"{tmp}/")), reverse=True):
        subprocess.run(["umount", point], check=False)


def _stop_left_over() -> None:
    """A dockerd that an earlier run started on this data root and did not stop (that run was
    killed): two daemons must never share one data root."""
    try:
        pid = int(DAEMON_PID.read_text())
        cmdline = Path(f"/proc/{pid}/cmdline").read_text()
    except (OSError, ValueError):
        return
    if "dockerd" in cmdline and str(DATA_ROOT) in cmdline:
        _stop(pid)


@pytest.fixture(scope="module")
def docker() -> Iterator[Docker]:
    DATA_ROOT.mkdir(parents=True, exist_ok=True)
    # A short path: the socket's must fit in sun_path (108 bytes).
    tmp = Path(tempfile.mkdtemp(prefix="k3d-", dir="/tmp"))
    with open(DATA_ROOT.parent / "docker.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        _stop_left_over()
        daemon = None
        try:
            for driver in ("overlay2", "vfs"):
                daemon = _start_dockerd(tmp, driver)
                if daemon is not None:
                    break
            if daemon is None:
                logs = "".join(p.read_text()[-2000:] for p in tmp.glob("dockerd-*.log"))
                pytest.fail(f"dockerd did not start with overlay2 or vfs:\n{logs}")
            yield Docker(tmp / "sock")
        finally:
            if daemon is not None:
                Docker(tmp / "sock")("image", "prune", "--force", check=False)
                _stop(daemon.pid)
            _unmount_under(tmp)
            shutil.rmtree(tmp, ignore_errors=True)


# ------------------------------------------------------------------------------------------
# The stand-in vLLM image.

TIMES: dict[str, float] = {}


def _key(*parts: str | bytes) -> str:
    digest = hashlib.sha256()
    for part in parts:
        digest.update(part.encode() if isinstance(part, str) else part)
        digest.update(b"\0")
    return digest.hexdigest()[:16]


def debian_image(docker: Docker) -> str:
    """Debian bookworm (minbase, python3, python3-venv), imported from a debootstrap tree."""
    tag = "k3patch-debian:" + _key(DEBIAN_MIRROR, *DEBOOTSTRAP)
    if docker.has_image(tag):
        return tag
    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="k3patch-debootstrap-") as rootfs:
        made = subprocess.run(
            ["debootstrap", *DEBOOTSTRAP, rootfs, DEBIAN_MIRROR],
            capture_output=True,
            text=True,
        )
        if made.returncode != 0:
            pytest.fail(f"debootstrap: exit {made.returncode}\n{made.stdout[-3000:]}{made.stderr}")
        tar = subprocess.Popen(["tar", "-C", rootfs, "-c", "."], stdout=subprocess.PIPE)
        docker("import", "-", tag, stdin=tar.stdout)
        assert tar.wait() == 0
    TIMES["Debian image: debootstrap and import"] = time.monotonic() - start
    return tag


def _pip_download(dest: Path, *args: str) -> None:
    """pip as this machine has it configured (its index, find-links and CA file)."""
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "-d", str(dest),
         "--python-version", "3.11", "--only-binary", ":all:", *args],
        check=True,
    )  # fmt: skip


@pytest.fixture(scope="module")
def vllm_image(docker: Docker, tmp_path_factory) -> str:
    """The stand-in vLLM image: /opt/venv (on PATH) holds vLLM 0.31.0, CPU torch and vLLM's
    pure-Python imports; its pip trusts this machine's CA file."""
    requirements = ROOT / "tests" / "vllm-import-requirements.txt"
    wheel = vllm_wheel(VERSION)
    start = time.monotonic()
    base = debian_image(docker)
    tag = "k3patch-vllm-standin:" + _key(
        base, wheel.name, requirements.read_bytes(), CA_FILE.read_bytes(), STANDIN_SETUP
    )
    if docker.has_image(tag):
        TIMES["stand-in image (cached)"] = time.monotonic() - start
        return tag
    wheels = tmp_path_factory.mktemp("standin-wheels")
    _pip_download(wheels, "-r", str(requirements))
    os.link(wheel, wheels / wheel.name)
    shutil.copy(requirements, wheels / "requirements.txt")
    shutil.copy(CA_FILE, wheels / "ca.crt")
    # `docker run` with the wheels mounted, then `docker commit`: no layer carries the wheels.
    name = "k3patch-standin-setup-" + tag.partition(":")[2]
    docker("rm", "--force", name, check=False)
    try:
        docker(
            "run", "--name", name, "--network", "none", "-v", f"{wheels}:/wheels:ro",
            base, "sh", "-ec", STANDIN_SETUP.format(wheel=wheel.name),
        )  # fmt: skip
        docker(
            "commit", "--change", "ENV PATH=/opt/venv/bin:/usr/local/sbin:/usr/local/bin:"
            "/usr/sbin:/usr/bin:/sbin:/bin", name, tag,
        )  # fmt: skip
    finally:
        docker("rm", "--force", name, check=False)
    TIMES["stand-in image (cold)"] = time.monotonic() - start
    return tag


STANDIN_SETUP = """
python3 -m venv /opt/venv
/opt/venv/bin/pip install --quiet --disable-pip-version-check --no-cache-dir --no-index \
  --no-deps --find-links /wheels -r /wheels/requirements.txt /wheels/{wheel}
/opt/venv/bin/python -c 'import vllm, torch'
cp /wheels/ca.crt /etc/ssl/certs/k3patch-host-ca.crt
printf '[global]\\ncert = /etc/ssl/certs/k3patch-host-ca.crt\\n' > /etc/pip.conf
"""


# ------------------------------------------------------------------------------------------
# The examples' build contexts.


@pytest.fixture(scope="module")
def wheel_dist(tmp_path_factory, k3patch_source) -> Path:
    """dist/ with the k3patch wheel, built as the README says (`pip wheel --no-deps . -w dist`)."""
    dist = tmp_path_factory.mktemp("dist") / "dist"
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", ".", "-w", str(dist)],
        cwd=k3patch_source,
        check=True,
    )
    return dist


@pytest.fixture(scope="module")
def installed_context(tmp_path_factory, wheel_dist) -> Path:
    """What Dockerfile.installed reads from a k3patch checkout: dist/ and the entrypoint."""
    context = tmp_path_factory.mktemp("installed-context")
    shutil.copytree(wheel_dist, context / "dist")
    (context / "examples").mkdir()
    shutil.copy2(EXAMPLES / "entrypoint.sh", context / "examples" / "entrypoint.sh")
    return context


def vllm_sdist() -> Path:
    """The vLLM sdist, cached beside the wheels. Fetched from the simple index pip reads, its
    sha256 checked against the index's: `pip download --no-binary :all:` would first build the
    sdist's metadata, installing its build requirements (CUDA torch among them)."""
    cached = CACHE.parent / "sdists" / f"vllm-{VERSION}.tar.gz"
    if cached.exists():
        return cached
    request = urllib.request.Request(
        "https://pypi.org/simple/vllm/",
        headers={"Accept": "application/vnd.pypi.simple.v1+json"},
    )
    with urllib.request.urlopen(request, timeout=60) as response:
        files = json.load(response)["files"]
    (entry,) = [f for f in files if f["filename"] == cached.name]
    with urllib.request.urlopen(entry["url"], timeout=300) as response:
        data = response.read()
    assert hashlib.sha256(data).hexdigest() == entry["hashes"]["sha256"], entry["url"]
    cached.parent.mkdir(parents=True, exist_ok=True)
    partial = cached.with_name(f".{cached.name}.{os.getpid()}")
    partial.write_bytes(data)
    partial.replace(cached)
    return cached


@pytest.fixture(scope="module")
def source_context(tmp_path_factory, wheel_dist) -> Path:
    """What Dockerfile.source reads: the vLLM source checkout in vllm/ and dist/."""
    where = tmp_path_factory.mktemp("source-context")
    context = where / "context"
    with tarfile.open(vllm_sdist()) as sdist:
        sdist.extractall(where, filter="data")
    context.mkdir()
    (where / f"vllm-{VERSION}").rename(context / "vllm")
    shutil.copytree(wheel_dist, context / "dist")
    return context


def readme_digest() -> str | None:
    """The digest README shows for a patched vLLM 0.31.0, if it shows one."""
    found = re.search(
        r"^\$ k3patch status --digest --vllm /tmp/vllm-0\.31\.0\n([0-9a-f]{16})$",
        (ROOT / "README.md").read_text(),
        re.MULTILINE,
    )
    return found.group(1) if found else None


def derived(docker: Docker, tag: str, base: str, *steps: str) -> str:
    """An image on `base` with `steps` (RUN lines), built from a Dockerfile on stdin."""
    dockerfile = f"FROM {base}\n" + "".join(f"RUN {step}\n" for step in steps)
    docker("build", "--network", "none", "--force-rm", "-t", tag, "-", input=dockerfile)
    return tag


# `and` -> `or` in is_mla_enabled: a shape k3patch does not know (drifted), wheel and sdist alike.
DRIFT = "s/return cls._AITER_ENABLED and cls._MLA_ENABLED/return cls._AITER_ENABLED or cls._MLA_ENABLED/"  # noqa: E501


def failed_step(output: str) -> tuple[str, int] | None:
    """The RUN command the legacy builder reports as failed, and its exit code."""
    found = re.search(r"The command '/bin/sh -c (.*)' returned a non-zero code: (\d+)", output)
    return (found.group(1), int(found.group(2))) if found else None


# ------------------------------------------------------------------------------------------
# Dockerfile.installed and the entrypoint.


@pytest.fixture(scope="module")
def installed(docker, vllm_image, installed_context) -> tuple[str, str]:
    tag = "k3patch-test-installed"
    proc, seconds = docker.build(
        EXAMPLES / "Dockerfile.installed",
        installed_context,
        tag,
        "--build-arg",
        f"BASE={vllm_image}",
    )
    TIMES["Dockerfile.installed"] = seconds
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return tag, proc.stdout


def test_installed_dockerfile_patches_and_verifies(docker, installed):
    tag, output = installed
    assert "aiter-mla-gfx942       applied" in output
    assert "\nverified" in output, output
    status = docker("run", "--rm", "--network", "none", "--entrypoint", "k3patch", tag, "status")
    assert "moriio-chunk-gate      applied" in status.stdout
    digest = docker(
        "run", "--rm", "--network", "none", "--entrypoint", "k3patch", tag, "status", "--digest"
    ).stdout.strip()
    assert re.fullmatch(r"[0-9a-f]{16}", digest), digest
    if (expected := readme_digest()) is not None:
        assert digest == expected


def test_installed_dockerfile_fails_on_drift(docker, vllm_image, installed_context):
    base = derived(
        docker, "k3patch-test-drifted", vllm_image, f"sed -i '{DRIFT}' {SITE}/vllm/_aiter_ops.py"
    )
    proc, seconds = docker.build(
        EXAMPLES / "Dockerfile.installed", installed_context, "k3patch-test-never",
        "--build-arg", f"BASE={base}",
    )  # fmt: skip
    TIMES["Dockerfile.installed on a drifted vLLM"] = seconds
    assert proc.returncode != 0
    output = proc.stdout + proc.stderr
    assert "aiter-mla-gfx942       drifted" in output, output
    assert failed_step(output) == ("k3patch apply  && k3patch status  && k3patch verify", 1), output
    assert not docker.has_image("k3patch-test-never")


def test_entrypoint_applies_then_starts_vllm(docker, installed, tmp_path):
    reverted = derived(docker, "k3patch-test-reverted", installed[0], "k3patch revert")
    pending = docker(
        "run",
        "--rm",
        "--network",
        "none",
        "--entrypoint",
        "k3patch",
        reverted,
        "status",
        check=False,
    )
    assert pending.returncode == 1, pending.stdout  # the entrypoint has the patching to do
    # A stand-in `vllm`: serving a model needs a GPU. It says how it was started and what tree
    # state it starts on.
    standin = tmp_path / "standin"
    standin.mkdir()
    (standin / "vllm").write_text(
        '#!/bin/sh\necho "stand-in vllm: $*"\nexec k3patch status --digest\n'
    )
    (standin / "vllm").chmod(0o755)
    proc = docker(
        "run", "--rm", "--network", "none", "-v", f"{standin}:/standin:ro",
        "-e", "VLLM_BIN=/standin/vllm", "-e", "NO_COLOR=1",
        reverted, "--model", "moonshotai/Kimi-K3",
    )  # fmt: skip
    lines = proc.stdout.splitlines()
    assert "k3patch: aiter-mla-gfx942: applied" in lines, proc.stdout
    assert "k3patch: moriio-chunk-gate: applied" in lines, proc.stdout
    assert lines[-2] == "stand-in vllm: serve --model moonshotai/Kimi-K3", proc.stdout
    assert (
        f"k3patch: digest {lines[-1]} (compare it across nodes: equal <=> same tree state)" in lines
    )
    if (expected := readme_digest()) is not None:
        assert lines[-1] == expected


# ------------------------------------------------------------------------------------------
# Dockerfile.source, up to the vLLM build step (it needs the ROCm toolchain).


def test_source_dockerfile_patches_the_checkout(docker, vllm_image, source_context):
    tag = "k3patch-test-source"
    proc, seconds = docker.build(
        EXAMPLES / "Dockerfile.source", source_context, tag,
        "--target", "patched", "--build-arg", f"BASE={vllm_image}",
    )  # fmt: skip
    TIMES["Dockerfile.source --target patched"] = seconds
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "pip install --no-build-isolation" not in proc.stdout  # stopped before the vLLM build
    status = docker(
        "run", "--rm", "--network", "none", tag, "k3patch", "status", "--vllm", "/src/vllm"
    )
    assert "(source checkout" in status.stdout
    assert "aiter-mla-gfx942       applied" in status.stdout
    assert "moriio-chunk-gate      applied" in status.stdout


def test_source_dockerfile_fails_on_drift(docker, vllm_image, source_context):
    target = source_context / "vllm" / "vllm" / "_aiter_ops.py"
    original = target.read_bytes()
    subprocess.run(["sed", "-i", DRIFT, str(target)], check=True)
    try:
        proc, seconds = docker.build(
            EXAMPLES / "Dockerfile.source", source_context, "k3patch-test-never",
            "--target", "patched", "--build-arg", f"BASE={vllm_image}",
        )  # fmt: skip
    finally:
        target.write_bytes(original)  # the context is the module's
    TIMES["Dockerfile.source on a drifted checkout"] = seconds
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert failed_step(output) == (
        "k3patch apply --vllm /src/vllm  && k3patch status --vllm /src/vllm",
        1,
    ), output
    assert "aiter-mla-gfx942       drifted" in output


@pytest.fixture(scope="module", autouse=True)
def _record_times():
    """What each step took, for the README's figures: ~/.cache/k3patch/docker-times.json."""
    yield
    if TIMES:
        (CACHE.parent / "docker-times.json").write_text(json.dumps(TIMES, indent=1) + "\n")
