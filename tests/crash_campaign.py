"""`kill -9` at random moments during real applies and reverts, then recovery, then a byte-for-byte
comparison with a tree that was never interrupted. Used by tests/test_crash.py (a short
campaign) and benchmarks/reliability.py (a long one, for the README's table)."""

from __future__ import annotations

import hashlib
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from conftest import interruptible

ENV = {**os.environ, "NO_COLOR": "1"}


def k3(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "k3patch", *args], capture_output=True, text=True, env=ENV
    )


def source_hashes(site: Path) -> dict[str, str]:
    """Every file outside k3patch's own state dir, and no temp litter allowed."""
    out = {}
    for path in sorted(site.rglob("*")):
        if path.is_file() and "/.k3patch/" not in str(path) and "__pycache__" not in str(path):
            out[str(path.relative_to(site))] = hashlib.sha256(path.read_bytes()).hexdigest()
    return out


@dataclass
class CampaignResult:
    runs: int = 0
    killed_mid_run: int = 0  # the process was still running when killed
    stopped_by_it: int = 0  # ... and did not then finish as if never signalled (exit 0)
    mixed_after_recovery: int = 0
    status_disagreed: int = 0
    litter: int = 0
    failures: list[str] = field(default_factory=list)


def campaign(
    pristine: Path,
    work: Path,
    runs: int,
    op: str,
    seed: int = 0,
    window: float | None = None,
    sig: int = signal.SIGKILL,
) -> CampaignResult:
    """`runs` times: copy the pristine tree (for op == "revert": an applied copy), start
    `k3patch <op>`, send `sig` (SIGKILL, or SIGTERM as `docker stop` does, or SIGINT) after a
    random delay, then run the recovering command (apply for "apply", revert for "revert") and
    compare with the uninterrupted result."""
    rng = random.Random(seed)
    result = CampaignResult()
    reference_patched = work / "reference-patched"
    shutil.copytree(pristine, reference_patched)
    assert k3("apply", "--vllm", str(reference_patched)).returncode == 0
    patched_hashes = source_hashes(reference_patched)
    original_hashes = source_hashes(pristine)
    if window is None:
        # Kill within the op's own duration (measured on a scratch copy), a little past it.
        scratch = work / "scratch"
        shutil.copytree(reference_patched if op == "revert" else pristine, scratch)
        start = time.perf_counter()
        k3(op, "--vllm", str(scratch))
        window = (time.perf_counter() - start) * 1.1
        shutil.rmtree(scratch)
    for i in range(runs):
        site = work / f"run-{i}"
        shutil.copytree(reference_patched if op == "revert" else pristine, site)
        proc = subprocess.Popen(
            # SIGINT at its default even in a background job, or a SIGINT run tests nothing.
            interruptible([sys.executable, "-m", "k3patch", op, "--vllm", str(site)]),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            env=ENV,
        )
        time.sleep(rng.uniform(0, window))
        signalled = proc.poll() is None
        if signalled:
            proc.send_signal(sig)
            result.killed_mid_run += 1
        if proc.wait() != 0 and signalled:
            result.stopped_by_it += 1
        result.runs += 1
        recover = k3(op, "--vllm", str(site))
        want = patched_hashes if op == "apply" else original_hashes
        got = source_hashes(site)
        if recover.returncode != 0 or got != want:
            result.mixed_after_recovery += 1
            result.failures.append(f"run {i}: rc={recover.returncode} {recover.stderr.strip()}")
        status = k3("status", "--vllm", str(site))
        if status.returncode != (0 if op == "apply" else 1):
            result.status_disagreed += 1
            result.failures.append(f"run {i}: status exited {status.returncode}")
        if [p for p in site.rglob("*") if ".k3patch-tmp." in p.name]:
            result.litter += 1
            result.failures.append(f"run {i}: temp files left")
        shutil.rmtree(site)
    return result


def upgrade(site: Path, new_root: Path, targets: list[str]) -> None:
    """What `pip install --upgrade` (or `--force-reinstall`) does to the files k3patch reads:
    every wheel file is replaced or removed; `vllm/.k3patch/` is not in the wheel's RECORD, so
    it stays."""
    for dist_info in site.glob("vllm-*.dist-info"):
        shutil.rmtree(dist_info)
    for dist_info in new_root.glob("vllm-*.dist-info"):
        shutil.copytree(dist_info, site / dist_info.name)
    for rel in ["__init__.py", "envs.py", *targets]:
        dst, src = site / "vllm" / rel, new_root / "vllm" / rel
        if src.exists():
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(src, dst)
        elif dst.exists():
            dst.unlink()
