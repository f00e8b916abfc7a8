"""The CPU part of benchmarks/kda_sync_bench.py (classify, rewrite, apply + revert, verify with
the probe) runs where CI runs, without a GPU. No timing is asserted, only that every step ran
and the probe passed."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
@pytest.mark.verify
def test_benchmark_cpu_part_runs(tmp_path, verify_python):
    out = tmp_path / "kda.json"
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "kda_sync_bench.py"),
            "--cpu-only",
            "--repeat",
            "1",
            "--verify-python",
            verify_python,
            "--json",
            str(out),
        ],
        capture_output=True,
        text=True,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads(out.read_text())
    assert "gpu_part" not in result
    cpu = result["cpu_part"]
    for step in (
        "classify (scan, no record)",
        "plan (rewrite + compile + re-classify)",
        "apply + revert (CLI, two processes)",
        "verify (import + probe, child interpreter)",
    ):
        assert cpu[step]["n"] == 1, step
    assert cpu["probe_summary"].startswith("no sync reachable with K3_KDA_GATHER_LOG unset")
    assert "| classify (scan, no record) |" in proc.stdout
