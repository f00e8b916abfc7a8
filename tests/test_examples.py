"""The operator recipes in examples/: shell syntax, the entrypoint against a real tree with a fake
`vllm` on PATH that records whether it was started, and the Dockerfiles' k3patch steps run as
a build would run them (the build must fail on drift)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"
BIN = Path(sys.executable).parent
pytestmark = pytest.mark.wheel


def test_entrypoint_shell_syntax():
    subprocess.run(["bash", "-n", str(EXAMPLES / "entrypoint.sh")], check=True)


def run_instructions(dockerfile: Path) -> list[str]:
    """The RUN instructions of a Dockerfile, continuation lines joined."""
    text = re.sub(r"\\\n", " ", dockerfile.read_text())
    return [line[4:].strip() for line in text.splitlines() if line.startswith("RUN ")]


@pytest.mark.parametrize("name", ["Dockerfile.installed", "Dockerfile.source"])
def test_dockerfile_run_steps_are_valid_shell(name):
    steps = run_instructions(EXAMPLES / name)
    assert any("k3patch apply" in step for step in steps)
    for step in steps:
        subprocess.run(["bash", "-n", "-c", step], check=True)


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
    lines = [line for line in proc.stdout.splitlines() if line.startswith("k3patch: ")]
    from k3patch.registry import all_patches

    assert len(lines) == len(all_patches()), proc.stdout
    assert "k3patch: aiter-mla-gfx942: applied" in lines


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


def test_entrypoint_warn_mode_starts_anyway(make_tree, fake_vllm):
    site = make_tree("0.31.0")
    drift(site)
    proc = entrypoint(site, fake_vllm, K3PATCH_ON_DRIFT="warn")
    assert proc.returncode == 0
    assert fake_vllm[1].exists()
    assert "starting vLLM anyway" in proc.stderr


def test_entrypoint_environment_error_is_forwarded(tmp_path, fake_vllm):
    proc = entrypoint(tmp_path / "no-such-tree", fake_vllm)
    assert proc.returncode == 2
    assert not fake_vllm[1].exists()


def build_step(dockerfile: str, site: Path, checkout: Path | None = None) -> int:
    """Run a Dockerfile's k3patch RUN step as the build would, with the tree the image has.
    Package installs are out of scope here and become no-ops."""
    steps = [s for s in run_instructions(EXAMPLES / dockerfile) if "k3patch apply" in s]
    assert len(steps) == 1
    step = re.sub(r"pip install [^&]*", ":", steps[0])
    if checkout is not None:
        step = step.replace("/src/vllm", str(checkout))
    env = {
        **os.environ,
        "PATH": f"{BIN}:{os.environ['PATH']}",
        "PYTHONPATH": str(site),
        "NO_COLOR": "1",
    }
    env.setdefault("K3PATCH_TEST_VLLM_PYTHON", sys.executable)
    return subprocess.run(["bash", "-c", step], env=env, capture_output=True).returncode


def test_installed_dockerfile_step(make_tree):
    good = make_tree("0.31.0")
    assert build_step("Dockerfile.installed", good) == 0
    bad = make_tree("0.31.0")
    drift(bad)
    assert build_step("Dockerfile.installed", bad) != 0


def test_source_dockerfile_step(make_tree, tmp_path):
    site = make_tree("0.31.0")
    checkout = tmp_path / "checkout"
    checkout.mkdir()
    (checkout / "pyproject.toml").write_text("[project]\nname = 'vllm'\n")
    shutil.move(str(site / "vllm"), checkout / "vllm")
    assert build_step("Dockerfile.source", site, checkout) == 0
    assert "envs.is_set" in (checkout / "vllm" / "_aiter_ops.py").read_text()
    drift_checkout = tmp_path / "drift"
    shutil.copytree(checkout, drift_checkout)
    shutil.rmtree(drift_checkout / "vllm" / ".k3patch")
    original = drift_checkout / "vllm" / "_aiter_ops.py"
    original.write_text(
        original.read_text().replace("return not on_gfx942()", "return on_gfx942()")
    )
    assert build_step("Dockerfile.source", site, drift_checkout) != 0
