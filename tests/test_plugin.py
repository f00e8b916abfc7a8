"""The vLLM plugin, loaded by vLLM's own plugin loader (`vllm.plugins.load_general_plugins`) from
a real 0.31.0 wheel tree, in an interpreter with torch (CPU): k3patch is installed there as a
package, so vLLM finds the entry point the way it would in production."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
from conftest import run_cli

pytestmark = [pytest.mark.wheel, pytest.mark.verify]
ROOT = Path(__file__).resolve().parent.parent
LOAD = "from vllm.plugins import load_general_plugins; load_general_plugins(); print('SERVING')"


@pytest.fixture(scope="module")
def k3patch_target(tmp_path_factory, verify_python, k3patch_source):
    target = tmp_path_factory.mktemp("k3patch-install")
    subprocess.run(
        [
            verify_python,
            "-m",
            "pip",
            "install",
            "--quiet",
            "--no-deps",
            "--no-compile",
            "--target",
            str(target),
            str(k3patch_source),
        ],
        check=True,
    )
    assert list(target.glob("k3patch-*.dist-info/entry_points.txt"))
    return target


def start_vllm(python: str, site: Path, k3patch_target: Path, mode: str | None):
    env = {**os.environ, "PYTHONPATH": f"{k3patch_target}:{site}", "VLLM_LOGGING_LEVEL": "DEBUG"}
    env.pop(ENV_NAME, None)
    if mode is not None:
        env[ENV_NAME] = mode
    return subprocess.run(
        [python, "-c", LOAD], env=env, capture_output=True, text=True, cwd=site, timeout=600
    )


ENV_NAME = "K3PATCH_PREFLIGHT"


def test_applied_tree_passes_silently(make_tree, verify_python, k3patch_target):
    site = make_tree("0.31.0", full=True)
    assert run_cli("apply", "--vllm", str(site)).returncode == 0
    proc = start_vllm(verify_python, site, k3patch_target, "fail")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "SERVING" in proc.stdout
    assert "k3patch preflight:" not in proc.stderr.replace("is in the applied state", "")


def test_pending_tree_warns_by_default_and_fails_when_asked(
    make_tree, verify_python, k3patch_target
):
    site = make_tree("0.31.0", full=True)
    default = start_vllm(verify_python, site, k3patch_target, None)
    assert default.returncode == 0 and "SERVING" in default.stdout
    assert "k3patch preflight: no k3patch state record" in default.stderr

    fail = start_vllm(verify_python, site, k3patch_target, "fail")
    assert fail.returncode != 0 and "SERVING" not in fail.stdout
    assert "PreflightError: k3patch preflight: no k3patch state record" in fail.stderr

    off = start_vllm(verify_python, site, k3patch_target, "off")
    assert off.returncode == 0 and "k3patch preflight" not in off.stderr


@pytest.mark.slow
def test_file_changed_after_apply_is_caught(make_tree, verify_python, k3patch_target):
    site = make_tree("0.31.0", full=True)
    assert run_cli("apply", "--vllm", str(site)).returncode == 0
    target = site / "vllm" / "_aiter_ops.py"
    # A reinstalled wheel: the original file is back.
    original = (site / "vllm" / ".k3patch" / "state.json").read_text()
    assert "_aiter_ops.py" in original
    from conftest import pristine_tree

    target.write_bytes((pristine_tree("0.31.0") / "vllm" / "_aiter_ops.py").read_bytes())
    proc = start_vllm(verify_python, site, k3patch_target, "fail")
    assert proc.returncode != 0
    assert "differ from what k3patch recorded" in proc.stderr


@pytest.mark.slow
def test_a_damaged_record_is_named_so_and_a_fifo_record_never_blocks(
    make_tree, verify_python, k3patch_target
):
    """Issue 21: a damaged record is 'record damaged' (not 'the vLLM files differ'); a FIFO
    where the record should be is named, and vLLM still starts in warn mode, never blocked."""
    site = make_tree("0.31.0", full=True)
    assert run_cli("apply", "--vllm", str(site)).returncode == 0
    record = site / "vllm" / ".k3patch" / "state.json"
    record.write_text(record.read_text()[:200])
    proc = start_vllm(verify_python, site, k3patch_target, "warn")
    assert proc.returncode == 0 and "SERVING" in proc.stdout, proc.stderr[-2000:]
    assert "k3patch preflight: record damaged:" in proc.stderr
    assert "differ from what k3patch recorded" not in proc.stderr
    record.unlink()
    os.mkfifo(record)
    proc = start_vllm(verify_python, site, k3patch_target, "warn")  # timeout: see start_vllm
    assert proc.returncode == 0 and "SERVING" in proc.stdout, proc.stderr[-2000:]
    assert "cannot be read by this process" in proc.stderr and "regular" in proc.stderr
