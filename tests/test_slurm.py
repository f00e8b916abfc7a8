"""The Slurm recipe (examples/slurm/) on a real Slurm: munged, slurmctld and four slurmd (n1..n4)
started on this machine by tests/slurm_cluster.py; skipped where Slurm is not installed
(.ci/run installs it) or the tests do not run as root.

How each node gets its own vLLM tree: the four nodes share this machine's filesystem, so the
`k3patch` first on the nodes' PATH is a wrapper that reads `--vllm DIR` as `DIR/$SLURMD_NODENAME`
(slurmd sets SLURMD_NODENAME in every task it starts), and `DIR/n1` .. `DIR/n4` are four real
vLLM trees made from the cached 0.31.0 wheel. Everything else is the real thing: srun, salloc,
sbatch (which runs a copy of the batch script from its spool directory), squeue, the preflight,
k3patch, examples/entrypoint.sh. Only `vllm` is a stand-in (no GPU here): it records which node
started it and with what arguments.

The preflight: every node applied -> 0; one node pending -> 4 naming it; a node whose slurmd is
dead -> 5 naming it; k3patch failing on a node -> 6 naming it; all pending -> 1; outside an
allocation -> 2 (and --jobid from outside finds a running job's nodes with squeue).
"""

from __future__ import annotations

import json
import shlex
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import slurm_cluster
from conftest import run_cli, tree_hashes

ROOT = Path(__file__).resolve().parent.parent
PREFLIGHT = ROOT / "examples" / "slurm" / "k3patch_preflight.py"
SBATCH = ROOT / "examples" / "slurm" / "serve-k3.sbatch"
BIN = Path(sys.executable).parent
NODES = slurm_cluster.NODES
pytestmark = pytest.mark.wheel

# `--vllm DIR` -> `--vllm DIR/<this node>`: each node of the test cluster reads its own tree.
NODE_K3PATCH = """#!/usr/bin/env bash
args=()
for arg in "$@"; do
  [ "${{prev:-}}" = --vllm ] && arg="$arg/${{SLURMD_NODENAME:?not started by slurmd}}"
  args+=("$arg")
  prev=$arg
done
exec {k3patch} "${{args[@]}}"
"""
# Stand-in for vLLM (no GPU here): one file per node, holding the arguments it was started with.
STAND_IN_VLLM = """#!/usr/bin/env bash
echo "$*" > "{started}/${{SLURMD_NODENAME:?not started by slurmd}}"
"""


@pytest.fixture(scope="session")
def slurm() -> Iterator[slurm_cluster.Cluster]:
    why = slurm_cluster.missing()
    if why:
        pytest.skip(why)
    cluster = slurm_cluster.Cluster()
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()


class Nodes:
    """Four real vLLM trees (one per node), the node-side `k3patch` wrapper and `vllm` stand-in."""

    def __init__(self, slurm: slurm_cluster.Cluster, root: Path, tree: Path) -> None:
        self.sites = root / "sites"
        self.sites.mkdir()
        for node in NODES:
            shutil.copytree(tree, self.sites / node, symlinks=True)
        self.bin = root / "bin"
        self.bin.mkdir()
        self.started = root / "vllm-started"
        self.started.mkdir()
        for name, text in (
            ("k3patch", NODE_K3PATCH.format(k3patch=shlex.quote(str(BIN / "k3patch")))),
            ("vllm", STAND_IN_VLLM.format(started=self.started)),
        ):
            (self.bin / name).write_text(text)
            (self.bin / name).chmod(0o755)
        self.env = {**slurm.env, "PATH": f"{self.bin}:{slurm.env['PATH']}", "NO_COLOR": "1"}

    def site(self, node: str) -> Path:
        return self.sites / node

    def k3patch(self, node: str, *args: str) -> subprocess.CompletedProcess:
        return run_cli(*args, "--vllm", str(self.site(node)))

    def digest(self, node: str) -> str:
        return self.k3patch(node, "status", "--digest").stdout.strip()

    def status(self, node: str) -> tuple[str, dict[str, str]]:
        """(digest, verdict by patch) of the node's tree, as k3patch reads it here."""
        data = json.loads(self.k3patch(node, "status", "--json").stdout)
        return data["digest"], {p["id"]: p["verdict"] for p in data["patches"]}

    def preflight(self, *args: str, nodes: int = 4, allocation: bool = True):
        """The preflight inside `salloc -N nodes` (allocation=False: as a login node runs it)."""
        cmd = [sys.executable, str(PREFLIGHT), *args, "--", "--vllm", str(self.sites)]
        if allocation:
            cmd = ["salloc", f"--nodes={nodes}", "--exclusive", *cmd]
        proc = subprocess.run(cmd, env=self.env, capture_output=True, text=True, timeout=120)
        for line in (proc.stdout + proc.stderr).splitlines():
            assert len(line) <= 100, line
        # Its messages are wrapped at 100 columns, continuation lines indented: read them whole.
        proc.stdout = proc.stdout.replace("\n    ", " ")
        proc.stderr = proc.stderr.replace("\n    ", " ")
        return proc


@pytest.fixture(scope="session")
def applied_tree(tmp_path_factory) -> Path:
    """A 0.31.0 tree applied once per session (apply is the costly step, about 2 s of CPU), then
    copied for each node: an applied tree's state record names no path of its own."""
    from conftest import _copier, pristine_tree

    site = _copier(tmp_path_factory.mktemp("slurm"), "applied", pristine_tree)("0.31.0")
    assert run_cli("apply", "--quiet", "--vllm", str(site)).returncode == 0
    return site


@pytest.fixture
def nodes(slurm, tmp_path, applied_tree) -> Nodes:
    """Four nodes whose trees are applied."""
    slurm.wait_idle()  # a previous test's job may still be completing
    return Nodes(slurm, tmp_path, applied_tree)


@pytest.fixture
def pending_nodes(slurm, tmp_path, make_tree) -> Nodes:
    """Four nodes whose trees are as the wheel installs them (every patch pending)."""
    slurm.wait_idle()
    return Nodes(slurm, tmp_path, make_tree("0.31.0"))


def failed_lines(proc) -> list[str]:
    return [line for line in proc.stderr.splitlines() if "FAILED" in line]


# ------------------------------------------------------------------------------------------
# The preflight inside an allocation.


@pytest.mark.slow
def test_every_node_applied(nodes):
    proc = nodes.preflight()
    assert proc.returncode == 0, proc.stdout + proc.stderr
    digest = nodes.digest("n1")
    assert f"4 node(s): {' '.join(NODES)}" in proc.stdout
    assert f"ok: all 4 node(s) report digest {digest}" in proc.stdout
    for node in NODES:
        assert f"  {node}: digest {digest}: aiter-mla-gfx942 applied" in proc.stdout
    assert nodes.preflight("--expect", digest).returncode == 0


def test_one_node_pending_is_named(nodes):
    assert nodes.k3patch("n3", "revert").returncode == 0
    proc = nodes.preflight()
    assert proc.returncode == 4, proc.stdout + proc.stderr
    (line,) = failed_lines(proc)
    assert f"FAILED: n3 differs from the other 3 node(s): digest {nodes.digest('n3')}" in line
    assert "aiter-mla-gfx942 pending (others applied)" in line
    assert "  n3: digest" in proc.stdout  # every node answered


@pytest.mark.slow
def test_two_nodes_in_two_halves_are_both_named(nodes):
    assert nodes.k3patch("n2", "revert").returncode == 0
    proc = nodes.preflight(nodes=2)
    assert proc.returncode == 4, proc.stdout + proc.stderr
    assert "2 node(s): n1 n2" in proc.stdout
    assert [ln.split(" differs")[0] for ln in failed_lines(proc)] == [
        "k3patch preflight: FAILED: n1",
        "k3patch preflight: FAILED: n2",
    ]
    # --expect says which half is right.
    proc = nodes.preflight("--expect", nodes.digest("n1"), nodes=2)
    assert proc.returncode == 4
    (line,) = failed_lines(proc)
    assert "FAILED: n2 differs from the other 1 node(s)" in line


@pytest.mark.slow
def test_a_node_whose_slurmd_is_dead_is_named(nodes, slurm):
    # The controller has not noticed yet (SlurmdTimeout), so salloc still gets all four nodes;
    # the preflight's srun then cannot start its task on n2.
    slurm.kill_slurmd("n2")
    try:
        proc = nodes.preflight()
    finally:
        slurm.start_slurmd("n2")
        slurm.wait_idle()
    assert proc.returncode == 5, proc.stdout + proc.stderr
    (line,) = failed_lines(proc)
    assert "FAILED: no answer from n2 (" in line
    # The reason is srun's line that names the node, not its closing "Job step aborted".
    assert "failed on node n2: " in line
    for node in ("n1", "n3", "n4"):
        assert f"  {node}: digest" in proc.stdout


@pytest.mark.slow
def test_k3patch_failing_on_a_node_is_named(nodes):
    nodes.site("n4").rename(nodes.sites / "n4-elsewhere")
    proc = nodes.preflight()
    assert proc.returncode == 6, proc.stdout + proc.stderr
    (line,) = failed_lines(proc)
    assert "FAILED on n4: k3patch exited " in line


@pytest.mark.slow
def test_the_same_everywhere_but_pending_needs_attention(pending_nodes):
    proc = pending_nodes.preflight()
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "all 4 node(s) agree" in proc.stderr and "aiter-mla-gfx942 pending" in proc.stderr


@pytest.mark.slow
def test_a_node_whose_apply_was_killed_before_its_journal_went_is_named(nodes):
    """Killed after every file was written, before its journal was removed: each file is what
    a clean node has, but this node's own status exits 1 and its next apply rolls back. Its
    digest differs from a clean node's, and the preflight names it (exit 4); when every node
    is so, they agree but need attention (exit 1). Before, both passed."""
    clean = nodes.digest(NODES[0])
    odd = NODES[1]
    killed = nodes.site(odd)
    crash = {"K3PATCH_TEST_CRASH_AT": "kept-removed"}

    def kill_apply(site: Path) -> None:
        assert run_cli("revert", "--vllm", str(site)).returncode == 0
        assert run_cli("apply", "--vllm", str(site), env=crash).returncode == 137
        assert (site / "vllm/.k3patch/journal.json").exists()

    kill_apply(killed)
    source = {k: v for k, v in tree_hashes(nodes.site(NODES[0])).items() if "/.k3patch/" not in k}
    assert {k: v for k, v in tree_hashes(killed).items() if "/.k3patch/" not in k} == source
    assert nodes.digest(odd) != clean
    proc = nodes.preflight("--expect", clean)
    assert proc.returncode == 4, proc.stdout + proc.stderr
    assert f"FAILED: {odd} differs" in proc.stderr
    # Every node killed the same way: they agree, and still need attention.
    for node in NODES:
        if node != odd:
            kill_apply(nodes.site(node))
    both = nodes.preflight()
    assert both.returncode == 1, both.stdout + both.stderr
    assert "interrupted apply" in both.stderr


def test_outside_an_allocation(nodes, slurm):
    proc = nodes.preflight(allocation=False)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "not inside a Slurm allocation" in proc.stderr
    assert proc.stdout == ""
    # From a login node, --jobid finds a running job's nodes with squeue.
    job = slurm.run(
        "sbatch", "--parsable", "--nodes=4", "--exclusive", "--output=/dev/null", "--wrap=sleep 120"
    )
    jobid = job.stdout.strip().split(";")[0]
    try:
        slurm_cluster.wait_for(
            lambda: slurm.run("squeue", "-h", "-j", jobid, "-o", "%T").stdout.strip() == "RUNNING",
            30,
            f"job {jobid} did not start",
        )
        proc = nodes.preflight("--jobid", jobid, allocation=False)
    finally:
        slurm.run("scancel", jobid, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"job {jobid}, 4 node(s): {' '.join(NODES)}" in proc.stdout
    gone = nodes.preflight("--jobid", "999999", allocation=False)
    assert gone.returncode == 2 and "job 999999 has no nodes" in gone.stderr


# ------------------------------------------------------------------------------------------
# The batch script, submitted as an operator does: `sbatch examples/slurm/serve-k3.sbatch`.


def sbatch(nodes: Nodes, tmp_path: Path, cwd: Path = ROOT, **env: str):
    out = tmp_path / "job.out"
    proc = subprocess.run(
        # From the checkout's root, the path an operator types; from elsewhere, the full one.
        [
            "sbatch",
            "--wait",
            f"--output={out}",
            str(SBATCH.relative_to(cwd) if cwd == ROOT else SBATCH),
            "--model",
            "moonshotai/Kimi-K3",
        ],
        env={**nodes.env, "VLLM_SITE": str(nodes.sites), **env},
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=300,
    )
    return proc.returncode, out.read_text() if out.exists() else proc.stderr


def started(nodes: Nodes) -> dict[str, str]:
    return {p.name: p.read_text().strip() for p in sorted(nodes.started.iterdir())}


def test_sbatch_applies_checks_and_starts_vllm_on_every_node(pending_nodes, tmp_path):
    nodes = pending_nodes
    rc, log = sbatch(nodes, tmp_path)
    assert rc == 0, log
    assert "k3patch preflight: ok: all 4 node(s) report digest" in log
    digest, verdicts = nodes.status("n1")
    assert verdicts["aiter-mla-gfx942"] == "applied"
    for node in NODES:
        assert nodes.status(node) == (digest, verdicts)
    assert started(nodes) == {node: "serve --model moonshotai/Kimi-K3" for node in NODES}
    # Each node went through the entrypoint: its digest line, then the exec of vLLM.
    assert log.count(f"k3patch: digest {digest} ") == 4
    assert log.count(f"exec {nodes.bin / 'vllm'} serve --model moonshotai/Kimi-K3") == 4


@pytest.mark.slow
def test_sbatch_stops_before_vllm_on_a_drifted_node(pending_nodes, tmp_path):
    nodes = pending_nodes
    aiter = nodes.site("n3") / "vllm" / "_aiter_ops.py"
    aiter.write_text(
        aiter.read_text().replace(
            "return cls._AITER_ENABLED and cls._MLA_ENABLED",
            "return cls._AITER_ENABLED or cls._MLA_ENABLED",
        )
    )
    rc, log = sbatch(nodes, tmp_path)
    assert rc == 4, log
    assert "k3patch apply exited 1 on some node" in log
    assert "FAILED: n3 differs from the other 3 node(s)" in log.replace("\n    ", " ")
    assert "aiter-mla-gfx942 drifted (others applied)" in log.replace("\n    ", " ")
    assert "not starting vLLM" in log
    assert started(nodes) == {}


@pytest.mark.slow
def test_sbatch_from_elsewhere_says_where_it_looked(pending_nodes, tmp_path):
    nodes = pending_nodes
    rc, log = sbatch(nodes, tmp_path, cwd=tmp_path)
    assert rc == 2, log
    assert f"serve-k3: error: no k3patch examples in {tmp_path}/examples " in log
    assert started(nodes) == {}
    # K3PATCH_EXAMPLES names them from anywhere.
    rc, log = sbatch(nodes, tmp_path, cwd=tmp_path, K3PATCH_EXAMPLES=str(ROOT / "examples"))
    assert rc == 0, log
    assert sorted(started(nodes)) == list(NODES)


# ------------------------------------------------------------------------------------------
# No Slurm needed.


def test_shell_syntax():
    subprocess.run(["bash", "-n", str(SBATCH)], check=True)


def test_nodelist_expansion():
    sys.path.insert(0, str(PREFLIGHT.parent))
    try:
        from k3patch_preflight import expand_nodelist
    finally:
        sys.path.pop(0)
    assert expand_nodelist("gpu[01-03,07],login1") == ["gpu01", "gpu02", "gpu03", "gpu07", "login1"]
    assert expand_nodelist("r[1-2]-n[1-2]") == ["r1-n1", "r1-n2", "r2-n1", "r2-n2"]
    assert expand_nodelist("node9") == ["node9"]
