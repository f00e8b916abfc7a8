"""The Slurm preflight (examples/slurm/k3patch_preflight.py) with a fake `srun` and `squeue` on
PATH: each fake node is a real vLLM tree that the real k3patch reads; a node can be made
unreachable. All equal -> 0; one node different -> 4, that node named; one node unreachable ->
5, that node named; not in an allocation -> 2."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import run_cli, slow_after

ROOT = Path(__file__).resolve().parent.parent
PREFLIGHT = ROOT / "examples" / "slurm" / "k3patch_preflight.py"
BIN = Path(sys.executable).parent
pytestmark = pytest.mark.wheel

# One task per node, run here one after the other: SLURMD_NODENAME and a PATH whose `k3patch`
# reads that node's tree; output lines labelled with the task number as `srun --label` does.
FAKE_SRUN = """#!{python}
import json, os, subprocess, sys
args = sys.argv[1:]
with open(os.environ["FAKE_SRUN_LOG"], "a") as log:
    log.write(json.dumps(args) + "\\n")
command = args[args.index("bash"):]
nodes = os.environ["FAKE_NODES"].split()
down = os.environ.get("FAKE_DOWN", "").split()
rc = 0
for task, node in enumerate(nodes):
    if node in down:
        why = "Communication connection failure"
        sys.stderr.write(f"srun: error: {{node}}: task {{task}}: {{why}}\\n")
        rc = 1
        continue
    env = dict(os.environ, SLURMD_NODENAME=node)
    env["PATH"] = os.path.join(os.environ["FAKE_NODE_BINS"], node) + os.pathsep + env["PATH"]
    out = subprocess.run(command, env=env, capture_output=True, text=True).stdout
    for line in out.splitlines():
        print(f"{{task}}: {{line}}")
sys.exit(rc)
"""
FAKE_SQUEUE = """#!/usr/bin/env bash
echo "$FAKE_NODELIST"
"""


class Cluster:
    def __init__(self, root: Path, make_tree, count: int) -> None:
        self.root = root
        self.nodes = [f"mi300x-{i:02d}" for i in range(1, count + 1)]
        self.nodelist = f"mi300x-[01-{count:02d}]"
        self.bin = root / "bin"
        self.bin.mkdir()
        for name, text in (
            ("srun", FAKE_SRUN.format(python=sys.executable)),
            ("squeue", FAKE_SQUEUE),
        ):
            (self.bin / name).write_text(text)
            (self.bin / name).chmod(0o755)
        self.trees: dict[str, Path] = {}
        for node in self.nodes:
            site = make_tree("0.31.0")
            assert run_cli("apply", "--quiet", "--vllm", str(site)).returncode == 0
            self.trees[node] = site
            node_bin = root / "nodes" / node
            node_bin.mkdir(parents=True)
            wrapper = node_bin / "k3patch"
            wrapper.write_text(f'#!/usr/bin/env bash\nexec {BIN / "k3patch"} "$@" --vllm {site}\n')
            wrapper.chmod(0o755)
        self.log = root / "srun.log"

    def preflight(self, *args: str, down: str = "", allocation: bool = True):
        env = {
            **os.environ,
            "PATH": f"{self.bin}:{os.environ['PATH']}",
            "FAKE_NODES": " ".join(self.nodes),
            "FAKE_NODELIST": self.nodelist,
            "FAKE_NODE_BINS": str(self.root / "nodes"),
            "FAKE_DOWN": down,
            "FAKE_SRUN_LOG": str(self.log),
        }
        for key in ("SLURM_JOB_ID", "SLURM_JOB_NODELIST"):
            env.pop(key, None)
        if allocation:
            env.update(SLURM_JOB_ID="4242", SLURM_JOB_NODELIST=self.nodelist)
        proc = subprocess.run(
            [sys.executable, str(PREFLIGHT), *args], env=env, capture_output=True, text=True
        )
        for line in (proc.stdout + proc.stderr).splitlines():
            assert len(line) <= 100, line
        # Its messages are wrapped at 100 columns, continuation lines indented: read them whole.
        proc.stdout = proc.stdout.replace("\n    ", " ")
        proc.stderr = proc.stderr.replace("\n    ", " ")
        return proc

    def digest(self, node: str) -> str:
        proc = run_cli("status", "--digest", "--vllm", str(self.trees[node]))
        return proc.stdout.strip()

    def srun_calls(self) -> list[list[str]]:
        return [json.loads(line) for line in self.log.read_text().splitlines()]


@pytest.fixture(params=slow_after([2, 4]), ids=lambda n: f"{n}-nodes")
def cluster(request, tmp_path, make_tree) -> Cluster:
    return Cluster(tmp_path, make_tree, request.param)


def test_all_nodes_equal(cluster):
    proc = cluster.preflight()
    assert proc.returncode == 0, proc.stdout + proc.stderr
    digest = cluster.digest(cluster.nodes[0])
    assert f"ok: all {len(cluster.nodes)} node(s) report digest {digest}" in proc.stdout
    for node in cluster.nodes:
        assert f"  {node}: digest {digest}: aiter-mla-gfx942 applied" in proc.stdout
    # One task per node, one srun for the whole check.
    (call,) = cluster.srun_calls()
    assert "--ntasks-per-node=1" in call and f"--nodes={len(cluster.nodes)}" in call
    assert call[-1] == "k3patch-preflight-task"  # no status arguments were given
    assert cluster.preflight("--expect", digest).returncode == 0


def test_one_node_differs(cluster):
    odd = cluster.nodes[-1]
    assert run_cli("revert", "--vllm", str(cluster.trees[odd])).returncode == 0
    good = cluster.digest(cluster.nodes[0])
    proc = cluster.preflight("--expect", good)
    assert proc.returncode == 4, proc.stdout + proc.stderr
    failed = [line for line in proc.stderr.splitlines() if "FAILED" in line]
    assert len(failed) == 1 and f"FAILED: {odd} differs" in failed[0], proc.stderr
    assert "aiter-mla-gfx942 pending (others applied)" in proc.stderr
    if len(cluster.nodes) > 2:
        # A majority needs no --expect to tell which node is the odd one.
        plain = cluster.preflight()
        assert plain.returncode == 4
        assert [ln for ln in plain.stderr.splitlines() if "FAILED" in ln] == failed


@pytest.mark.slow
def test_two_halves_without_expect_name_both(make_tree, tmp_path):
    cluster = Cluster(tmp_path, make_tree, 2)
    assert run_cli("revert", "--vllm", str(cluster.trees[cluster.nodes[1]])).returncode == 0
    proc = cluster.preflight()
    assert proc.returncode == 4
    for node in cluster.nodes:
        assert f"FAILED: {node} differs" in proc.stderr


@pytest.mark.slow
def test_one_node_unreachable(cluster):
    down = cluster.nodes[1]
    proc = cluster.preflight(down=down)
    assert proc.returncode == 5, proc.stdout + proc.stderr
    assert f"no answer from {down} " in proc.stderr
    assert "Communication connection failure" in proc.stderr


@pytest.mark.slow
def test_k3patch_failing_on_a_node_is_named(cluster, tmp_path):
    broken = cluster.nodes[0]
    wrapper = cluster.root / "nodes" / broken / "k3patch"
    wrapper.write_text(f'#!/usr/bin/env bash\nexec {BIN / "k3patch"} "$@" --vllm {tmp_path}\n')
    proc = cluster.preflight()
    assert proc.returncode == 6, proc.stdout + proc.stderr
    assert f"FAILED on {broken}: k3patch exited 2: " in proc.stderr
    assert "not a vLLM tree" in proc.stderr


@pytest.mark.slow
def test_same_everywhere_but_pending_needs_attention(cluster):
    for node in cluster.nodes:
        assert run_cli("revert", "--vllm", str(cluster.trees[node])).returncode == 0
    proc = cluster.preflight()
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "agree" in proc.stderr and "aiter-mla-gfx942 pending" in proc.stderr


def test_outside_an_allocation(make_tree, tmp_path):
    cluster = Cluster(tmp_path, make_tree, 2)
    proc = cluster.preflight(allocation=False)
    assert proc.returncode == 2
    assert "not inside a Slurm allocation" in proc.stderr
    # From a login node: --jobid finds the nodes with squeue.
    proc = cluster.preflight("--jobid", "4242", allocation=False)
    assert proc.returncode == 0, proc.stderr
    assert "job 4242, 2 node(s): mi300x-01 mi300x-02" in proc.stdout


def test_nodelist_expansion():
    sys.path.insert(0, str(PREFLIGHT.parent))
    try:
        from k3patch_preflight import expand_nodelist
    finally:
        sys.path.pop(0)
    assert expand_nodelist("gpu[01-03,07],login1") == ["gpu01", "gpu02", "gpu03", "gpu07", "login1"]
    assert expand_nodelist("r[1-2]-n[1-2]") == ["r1-n1", "r1-n2", "r2-n1", "r2-n2"]
    assert expand_nodelist("node9") == ["node9"]
