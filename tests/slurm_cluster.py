"""A real Slurm cluster on this machine, for tests/test_slurm.py.

Debian's `slurm-wlm` and `munge` (.ci/run installs them when `slurmctld` is absent): one
`munged` with its own key and socket, one `slurmctld` and four `slurmd -N n1..n4` that all run
here (one `NodeName=n[1-4]` line, every node's NodeHostname this host, one port each). Every
path (config, key, socket, state, spool, logs) lies under the cluster's own directory and the
ports are free ones, so two runs on one machine (two xdist workers, two checkouts) do not meet.
The daemons run in the foreground as children of the test process; `stop()` ends them. A run
that died without stopping them (SIGKILL) leaves a `pids` file; the next `start()` ends the
daemons it names that still run from that directory.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

NODES = ("n1", "n2", "n3", "n4")
# Every cluster's directory lies under this one, so a later run can find a dead run's daemons.
BASE = Path(tempfile.gettempdir()) / "k3patch-slurm"
DAEMONS = ("slurmctld", "slurmd", "munged")


def missing() -> str | None:
    """Why a cluster cannot start here (not root, a daemon not installed), or None."""
    if os.geteuid() != 0:
        return "the test Slurm runs its daemons as root (SlurmUser=root): run the tests as root"
    absent = [
        name
        for name in (*DAEMONS, "sbatch", "srun", "salloc", "scontrol", "sinfo")
        if not _which(name)
    ]
    if absent:
        return (
            f"a real Slurm needs {', '.join(absent)} (Debian: apt-get install slurm-wlm munge; "
            ".ci/run installs them)"
        )
    return None


def _which(name: str) -> str | None:
    return shutil.which(name, path=f"{os.environ.get('PATH', '')}:/usr/sbin:/sbin")


class SlurmError(RuntimeError):
    pass


class Cluster:
    def __init__(self) -> None:
        BASE.mkdir(mode=0o700, exist_ok=True)
        self.root = Path(tempfile.mkdtemp(prefix="run-", dir=BASE))
        (self.root / "owner").write_text(f"{os.getpid()}\n")
        self.host = socket.gethostname().split(".")[0]
        self.conf = self.root / "slurm.conf"
        self.socket = self.root / "munge" / "munge.socket"
        self.procs: dict[str, subprocess.Popen] = {}
        self.ports: list[int] = []

    # -- environment for the Slurm clients ------------------------------------------------

    @property
    def env(self) -> dict[str, str]:
        """os.environ with SLURM_CONF set to this cluster and no job of an outer allocation."""
        env = {
            k: v
            for k, v in os.environ.items()
            if not k.startswith(("SLURM_", "SBATCH_", "SALLOC_", "SRUN_"))
        }
        env["SLURM_CONF"] = str(self.conf)
        return env

    def run(
        self, *cmd: str, check: bool = True, timeout: float = 60, **kw
    ) -> subprocess.CompletedProcess:
        kw.setdefault("env", self.env)
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, **kw)
        if check and proc.returncode != 0:
            raise SlurmError(f"{' '.join(cmd)} exited {proc.returncode}: {proc.stderr.strip()}")
        return proc

    # -- start and stop -------------------------------------------------------------------

    def start(self, timeout: float = 60) -> None:
        reap_dead_runs()
        for sub in ("munge", "state", "log", *(f"spool/{node}" for node in NODES)):
            (self.root / sub).mkdir(mode=0o700, parents=True)
        key = self.root / "munge" / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        # Ports chosen and bound under one lock: two clusters starting at once take different ones.
        with open(BASE / ".ports.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            self.ports = free_ports(1 + len(NODES))
            self.conf.write_text(self.config())
            self._spawn(
                "munged",
                [
                    _which("munged") or "munged",
                    "--foreground",
                    "--force",
                    f"--socket={self.socket}",
                    f"--key-file={key}",
                    f"--log-file={self.root / 'log' / 'munged.log'}",
                    f"--pid-file={self.root / 'munge' / 'munged.pid'}",
                    f"--seed-file={self.root / 'munge' / 'munged.seed'}",
                ],
            )
            wait_for(lambda: self.socket.exists(), 10, "munged did not create its socket", self)
            self._spawn(
                "slurmctld", [_which("slurmctld") or "slurmctld", "-D", "-i", "-f", str(self.conf)]
            )
            wait_for(
                lambda: self._listening(self.ports[0]), timeout, "slurmctld did not listen", self
            )
            for node in NODES:
                self.start_slurmd(node)
        self.wait_idle(timeout)

    def start_slurmd(self, node: str) -> None:
        self._spawn(
            f"slurmd-{node}", [_which("slurmd") or "slurmd", "-D", "-N", node, "-f", str(self.conf)]
        )

    def kill_slurmd(self, node: str) -> None:
        proc = self.procs.pop(f"slurmd-{node}")
        proc.kill()
        proc.wait()

    def stop(self) -> None:
        """End every daemon this cluster started (slurmd first, munged last), then its files."""
        for name in sorted(self.procs, key=lambda n: ("slurmd" not in n, n == "munged")):
            proc = self.procs[name]
            if proc.poll() is None:
                proc.terminate()
        deadline = time.monotonic() + 10
        for proc in self.procs.values():
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self.procs.clear()
        shutil.rmtree(self.root, ignore_errors=True)

    def _spawn(self, name: str, cmd: list[str]) -> None:
        log = open(self.root / "log" / f"{name}.out", "wb")
        self.procs[name] = subprocess.Popen(
            cmd,
            env=self.env,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        log.close()
        with open(self.root / "pids", "a") as pids:
            pids.write(f"{self.procs[name].pid}\n")

    def _listening(self, port: int) -> bool:
        with socket.socket() as probe:
            return probe.connect_ex(("127.0.0.1", port)) == 0

    # -- node states ----------------------------------------------------------------------

    def states(self) -> dict[str, str]:
        """Each node's state as slurmctld reports it ({} while it does not answer)."""
        try:
            out = self.run("sinfo", "-h", "-N", "-o", "%N %T", check=False, timeout=20).stdout
        except subprocess.TimeoutExpired:
            return {}
        return dict(line.split() for line in out.splitlines() if len(line.split()) == 2)

    def wait_idle(self, timeout: float = 60) -> None:
        """Until every node is idle (back from a job, or a killed slurmd): at most `timeout`."""

        def idle() -> bool:
            states = self.states()
            for node, state in states.items():
                if state.startswith(("down", "drain", "fail")) and "slurmd-" + node in self.procs:
                    self.run("scontrol", "update", f"nodename={node}", "state=resume", check=False)
            return sorted(states) == list(NODES) and all(s == "idle" for s in states.values())

        wait_for(idle, timeout, "the nodes did not become idle", self)

    def log_tail(self, lines: int = 15) -> str:
        out = []
        for path in sorted((self.root / "log").glob("*")):
            text = path.read_text(errors="replace").splitlines()[-lines:]
            out.append(f"--- {path.name}\n" + "\n".join(text))
        return "\n".join(out)

    def config(self) -> str:
        ctld, *slurmd = self.ports
        nodes = f"n[1-{len(NODES)}]"
        # Every node is this host; slurmd -N picks which one a daemon is, Port which it listens on.
        node_line = (
            f"NodeName={nodes} NodeHostname={self.host} NodeAddr=127.0.0.1"
            f" Port=[{slurmd[0]}-{slurmd[-1]}] CPUs=1 State=UNKNOWN"
        )
        return f"""\
ClusterName=k3p{self.root.name.replace("-", "").replace("_", "").lower()[-10:]}
SlurmctldHost={self.host}(127.0.0.1)
SlurmctldPort={ctld}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={self.socket}
StateSaveLocation={self.root / "state"}
SlurmdSpoolDir={self.root / "spool"}/%n
SlurmctldPidFile={self.root / "slurmctld.pid"}
SlurmdPidFile={self.root / "spool"}/slurmd-%n.pid
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/linear
SchedulerType=sched/builtin
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
MpiDefault=none
ReturnToService=2
# `sbatch --wait` polls every 2 s while MinJobAge/2 is under 4 s, else every 8 s.
MinJobAge=4
SlurmdTimeout=30
InactiveLimit=0
KillWait=2
{node_line}
PartitionName=test Nodes={nodes} Default=YES MaxTime=INFINITE State=UP OverSubscribe=EXCLUSIVE
"""


def free_ports(count: int) -> list[int]:
    """`count` consecutive TCP ports that nothing listens on (slurmd's Port=[a-b] is a range)."""
    for _ in range(200):
        # Below Linux's ephemeral range (32768-60999), where srun's own ports come from.
        base = 20000 + int.from_bytes(os.urandom(2), "big") % 12000
        ports = list(range(base, base + count))
        if all(_bindable(p) for p in ports):
            return ports
    raise SlurmError(f"no {count} consecutive free ports found")


def _bindable(port: int) -> bool:
    with socket.socket() as probe:
        try:
            probe.bind(("", port))
        except OSError:
            return False
    return True


def wait_for(ready, timeout: float, what: str, cluster: Cluster | None = None) -> None:
    """Poll `ready()` until true; past `timeout` (or a daemon of `cluster` died) raise `what`."""
    deadline = time.monotonic() + timeout
    while not ready():
        dead = [n for n, p in cluster.procs.items() if p.poll() is not None] if cluster else []
        if dead or time.monotonic() > deadline:
            why = f"{', '.join(dead)} exited" if dead else f"after {timeout:g} s"
            raise SlurmError(f"{what} ({why})" + (f"\n{cluster.log_tail()}" if cluster else ""))
        time.sleep(0.2)


def reap_dead_runs() -> None:
    """End the daemons of earlier runs whose test process died without stopping them."""
    for run in BASE.glob("run-*"):
        pids = run / "pids"
        try:
            if _alive(int((run / "owner").read_text())):
                continue
        except (OSError, ValueError):
            try:
                if time.time() - run.stat().st_mtime < 60:
                    continue  # being created (no owner written yet)
            except OSError:
                continue  # another run's reaper removed it
        for line in pids.read_text().split() if pids.exists() else []:
            pid = int(line)
            try:
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
            except OSError:
                continue
            # Only a daemon of that run: its command line names the run's own directory.
            if str(run).encode() in cmdline:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        shutil.rmtree(run, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True
