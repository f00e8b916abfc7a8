"""The operator recipes in examples/: the entrypoint against a real tree with a fake `vllm` on
PATH that records whether it was started, the shell syntax of the Dockerfiles' RUN steps, and the
Kubernetes init check. tests/test_docker.py builds the Dockerfiles with a real dockerd and starts
the entrypoint in a container."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import run_cli, tree_hashes

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"
BIN = Path(sys.executable).parent
pytestmark = pytest.mark.wheel
CONNECTOR = "distributed/kv_transfer/kv_connector/v1/moriio/moriio_connector.py"


def test_shell_syntax():
    subprocess.run(["bash", "-n", str(EXAMPLES / "entrypoint.sh")], check=True)
    for name in ("Dockerfile.installed", "Dockerfile.source"):
        for kind, args in instructions(EXAMPLES / name):
            if kind == "RUN":
                subprocess.run(["bash", "-n", "-c", args], check=True)


def instructions(dockerfile: Path) -> list[tuple[str, str]]:
    """The COPY and RUN instructions of a Dockerfile, in order, continuation lines joined."""
    text = re.sub(r"\\\n", " ", dockerfile.read_text())
    found = []
    for line in text.splitlines():
        kind, _, args = line.partition(" ")
        if kind in ("COPY", "RUN"):
            found.append((kind, args.strip()))
    return found


# ------------------------------------------------------------------------------------------
# The entrypoint.


@pytest.fixture
def fake_vllm(tmp_path):
    bindir = tmp_path / "fakebin"
    bindir.mkdir()
    record = tmp_path / "vllm-started"
    script = bindir / "vllm"
    script.write_text(f'#!/usr/bin/env bash\necho "$@" > {record}\nexit "${{FAKE_VLLM_EXIT:-0}}"\n')
    script.chmod(0o755)
    return bindir, record


def entrypoint(site: Path, fake, *args: str, **env: str) -> subprocess.CompletedProcess:
    bindir, _ = fake
    full_env = {
        **os.environ,
        "PATH": f"{bindir}:{BIN}:{os.environ['PATH']}",
        "K3PATCH_ARGS": f"--vllm {site}",
        "K3PATCH_BIN": str(BIN / "k3patch"),
        "NO_COLOR": "1",
        **env,
    }
    return subprocess.run(
        ["bash", str(EXAMPLES / "entrypoint.sh"), *args],
        env=full_env,
        capture_output=True,
        text=True,
    )


def drift(site: Path) -> None:
    target = site / "vllm" / "_aiter_ops.py"
    target.write_text(
        target.read_text().replace(
            "return cls._AITER_ENABLED and cls._MLA_ENABLED",
            "return cls._AITER_ENABLED or cls._MLA_ENABLED",
        )
    )


def test_entrypoint_patches_then_starts_vllm(make_tree, fake_vllm):
    site = make_tree("0.31.0")
    proc = entrypoint(site, fake_vllm, "--model", "moonshotai/Kimi-K3")
    assert proc.returncode == 0, proc.stderr
    assert fake_vllm[1].read_text().strip() == "serve --model moonshotai/Kimi-K3"
    lines = proc.stdout.splitlines()
    from k3patch import __version__
    from k3patch.registry import all_patches

    # Which k3patch, one line per patch, the digest, and the vllm it execs.
    assert lines[0] == f"k3patch: k3patch {__version__} ({BIN / 'k3patch'})"
    patch_lines = [line for line in lines if re.match(r"k3patch: [a-z0-9-]+: ", line)]
    assert len(patch_lines) == len(all_patches()), proc.stdout
    assert "k3patch: aiter-mla-gfx942: applied" in patch_lines
    digest = run_cli("status", "--digest", "--vllm", str(site)).stdout.strip()
    assert re.fullmatch(r"[0-9a-f]{16}", digest)
    assert f"k3patch: digest {digest} (compare it across nodes: equal <=> same tree state)" in lines
    assert lines[-1] == f"k3patch: exec {fake_vllm[0] / 'vllm'} serve --model moonshotai/Kimi-K3"


def test_entrypoint_forwards_vllm_exit_code(make_tree, fake_vllm):
    site = make_tree("0.31.0")
    proc = entrypoint(site, fake_vllm, FAKE_VLLM_EXIT="7")
    assert proc.returncode == 7


def test_entrypoint_fails_closed_on_drift(make_tree, fake_vllm):
    site = make_tree("0.31.0")
    drift(site)
    proc = entrypoint(site, fake_vllm)
    assert proc.returncode == 1
    assert not fake_vllm[1].exists()
    assert "not starting vLLM" in proc.stderr
    assert "aiter-mla-gfx942: drifted: vllm/_aiter_ops.py" in proc.stdout


def test_entrypoint_warn_mode_starts_with_the_safe_fixes(make_tree, fake_vllm):
    site = make_tree("0.31.0")
    drift(site)
    proc = entrypoint(site, fake_vllm, K3PATCH_ON_DRIFT="warn")
    assert proc.returncode == 0, proc.stderr
    assert fake_vllm[1].exists()
    warnings = [line for line in proc.stderr.splitlines() if "WITHOUT this fix" in line]
    assert warnings == [
        "k3patch: warning: aiter-mla-gfx942 is drifted: vLLM starts WITHOUT this fix "
        "(K3PATCH_ON_DRIFT=warn)"
    ]
    assert "starting vLLM anyway" in proc.stderr
    assert "k3patch: moriio-chunk-gate: applied" in proc.stdout
    assert "envs.is_set" not in (site / "vllm" / "_aiter_ops.py").read_text()


def test_entrypoint_warn_mode_all_or_nothing_names_every_missing_fix(make_tree, fake_vllm):
    site = make_tree("0.31.0")
    drift(site)
    proc = entrypoint(
        site,
        fake_vllm,
        K3PATCH_ON_DRIFT="warn",
        K3PATCH_ARGS=f"--vllm {site} --all-or-nothing",
    )
    assert proc.returncode == 0, proc.stderr
    missing = re.findall(r"warning: (\S+) is (\S+): vLLM starts WITHOUT", proc.stderr)
    assert missing == [("aiter-mla-gfx942", "drifted"), ("moriio-chunk-gate", "pending")]


def test_entrypoint_usage_error_is_forwarded(tmp_path, fake_vllm):
    proc = entrypoint(tmp_path / "no-such-tree", fake_vllm)
    assert proc.returncode == 2
    assert "exit 2 (usage or internal error" in proc.stderr
    assert not fake_vllm[1].exists()


def test_entrypoint_without_k3patch_says_so(make_tree, fake_vllm):
    site = make_tree("0.31.0")
    before = tree_hashes(site)
    proc = entrypoint(site, fake_vllm, K3PATCH_BIN="k3patch-not-installed")
    assert proc.returncode == 127
    assert "'k3patch-not-installed' is not on PATH: k3patch is not installed" in proc.stderr
    assert not fake_vllm[1].exists() and tree_hashes(site) == before


def test_entrypoint_without_vllm_patches_nothing(make_tree, fake_vllm):
    site = make_tree("0.31.0")
    before = tree_hashes(site)
    proc = entrypoint(site, fake_vllm, VLLM_BIN="vllm-not-installed")
    assert proc.returncode == 127
    assert "'vllm-not-installed' is not on PATH: no vLLM to start" in proc.stderr
    assert tree_hashes(site) == before


# ------------------------------------------------------------------------------------------
# The Kubernetes initContainer check.


def init_script() -> str:
    """The shell script of the initContainer (the `- |` block under its args)."""
    lines = (EXAMPLES / "kubernetes" / "k3patch-check.yaml").read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.strip() == "- |")
    indent = len(lines[start + 1]) - len(lines[start + 1].lstrip())
    body = []
    for line in lines[start + 1 :]:
        if line.strip() and len(line) - len(line.lstrip()) < indent:
            break
        body.append(line[indent:])
    return "\n".join(body) + "\n"


def run_init(site: Path, expect: str) -> subprocess.CompletedProcess:
    env = {
        **os.environ,
        "PATH": f"{BIN}:{os.environ['PATH']}",
        "PYTHONPATH": str(site),  # the image's vLLM, found by the interpreter k3patch runs on
        "K3PATCH_EXPECT_DIGEST": expect,
        "NO_COLOR": "1",
    }
    return subprocess.run(["sh", "-ec", init_script()], env=env, capture_output=True, text=True)


def test_kubernetes_init_check(make_tree):
    site = make_tree("0.31.0")
    assert run_cli("apply", "--quiet", "--vllm", str(site)).returncode == 0
    digest = run_cli("status", "--digest", "--vllm", str(site)).stdout.strip()
    proc = run_init(site, digest)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"k3patch: digest {digest} as expected" in proc.stdout
    other = run_init(site, "0" * 16)
    assert other.returncode == 1
    assert "is not the one the other pods carry" in other.stderr
    pending = make_tree("0.31.0")  # an image built without k3patch apply
    assert run_init(pending, digest).returncode == 1


def test_entrypoint_refuses_an_unknown_drift_mode(make_tree, fake_vllm):
    site = make_tree("0.31.0")
    before = tree_hashes(site)
    proc = entrypoint(site, fake_vllm, K3PATCH_ON_DRIFT="ignore")
    assert proc.returncode == 2
    assert "K3PATCH_ON_DRIFT=ignore; use fail or warn" in proc.stderr
    assert not fake_vllm[1].exists() and tree_hashes(site) == before


@pytest.mark.parametrize("option", ["--check", "--help", "-h"])
@pytest.mark.parametrize("mode", ["fail", "warn"])
def test_entrypoint_refuses_args_that_make_apply_write_nothing(make_tree, fake_vllm, option, mode):
    """`--check` made apply exit 1 on a pending tree, which the script read as drift (under
    warn: "every other fix is applied", none was); `--help` exited 0 and vLLM started
    unpatched. Both are refused before anything runs: one line, exit 2."""
    site = make_tree("0.31.0")
    before = tree_hashes(site)
    proc = entrypoint(
        site, fake_vllm, K3PATCH_ON_DRIFT=mode, K3PATCH_ARGS=f"--vllm {site} {option}"
    )
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    (line,) = proc.stderr.splitlines()
    assert line.startswith(f"k3patch: error: K3PATCH_ARGS has {option}: "), line
    assert not fake_vllm[1].exists() and tree_hashes(site) == before
