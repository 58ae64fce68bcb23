"""A real two-node Slurm cluster on this machine for tests: munged, slurmctld, `slurmd -N node1/node2`.

Everything lives in one temporary directory: a private munge key and socket (so an existing
munged is neither used nor disturbed), slurm.conf (clients find it through SLURM_CONF), state,
spool, logs and pid files. Daemons listen on free loopback ports. Needs root (slurmd starts job
steps as the submitting user) and Debian's `slurm-wlm` and `munge`; `ensure_installed()` installs
them with apt-get when they are missing and we are root.

    with SlurmCluster(tmp_path) as cluster:
        job_id = cluster.sbatch(["slurm/pretrain.sh", ...])
        cluster.wait_done(job_id)
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path
from typing import Optional

from .ports import free_port

NODES = ("node1", "node2")
DAEMONS = ("munged", "slurmctld", "slurmd", "sbatch", "srun", "scontrol", "squeue")


def slurm_available() -> bool:
    return all(shutil.which(t) or os.path.exists(f"/usr/sbin/{t}") for t in DAEMONS)


def ensure_installed() -> None:
    """apt-get installs slurm-wlm and munge when missing (root only; the caller skips otherwise)."""
    if slurm_available():
        return
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    subprocess.run(["apt-get", "update", "-qq"], check=True, env=env)
    subprocess.run(["apt-get", "install", "-y", "-qq", "slurm-wlm", "munge"], check=True, env=env)


def _slurm_conf(d: Path, ctld_port: int, node_ports: dict[str, int], cpus_per_node: int) -> str:
    nodes = "\n".join(
        f"NodeName={n} NodeHostname={socket.gethostname()} NodeAddr=127.0.0.1 Port={p} CPUs={cpus_per_node} "
        f"RealMemory=4000 State=UNKNOWN" for n, p in node_ports.items())
    return f"""\
ClusterName=megaroute-test
SlurmctldHost={socket.gethostname()}(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={d}/munge.socket
StateSaveLocation={d}/state
SlurmdSpoolDir={d}/spool-%n
SlurmctldPidFile={d}/slurmctld.pid
SlurmdPidFile={d}/slurmd-%n.pid
SlurmctldLogFile={d}/slurmctld.log
SlurmdLogFile={d}/slurmd-%n.log
SlurmctldDebug=info
SlurmdDebug=info
# No cgroups in containers: track processes by parent id, bind nothing.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MpiDefault=none
SwitchType=switch/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
SlurmdParameters=config_overrides
# Requeued jobs become eligible at once, and finished jobs stay visible to scontrol for a while.
MinJobAge=600
# Seconds from SIGTERM to SIGKILL when a job is cancelled: the ranks checkpoint and exit in between.
# Slurm's default; 5 s is too short on a loaded 2-core machine.
KillWait=30
InactiveLimit=0
{nodes}
PartitionName=debug Nodes={",".join(node_ports)} Default=YES MaxTime=INFINITE State=UP
"""


class SlurmCluster:
    def __init__(self, workdir: Path, cpus_per_node: int = 1):
        self.dir = Path(workdir)
        self.cpus_per_node = cpus_per_node
        self.conf = self.dir / "slurm.conf"
        self.procs: list[subprocess.Popen] = []

    @property
    def env(self) -> dict[str, str]:
        """Environment for client commands (sbatch, squeue, ...) and the jobs they submit."""
        return {**os.environ, "SLURM_CONF": str(self.conf)}

    # ---- lifecycle ----
    def start(self) -> "SlurmCluster":
        d = self.dir
        for sub in ("state", *(f"spool-{n}" for n in NODES)):
            (d / sub).mkdir(parents=True, exist_ok=True)
        key = d / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        self._spawn(["munged", "--foreground", "--force", f"--socket={d}/munge.socket", f"--key-file={key}",
                     f"--pid-file={d}/munged.pid", f"--log-file={d}/munged.log", f"--seed-file={d}/munged.seed"],
                    "munged.out")
        self._wait(lambda: (d / "munge.socket").exists(), "munged socket", 30)
        node_ports = {n: free_port() for n in NODES}
        self.conf.write_text(_slurm_conf(d, free_port(), node_ports, self.cpus_per_node))
        self._spawn(["slurmctld", "-D", "-i", "-f", str(self.conf)], "slurmctld.out")
        for n in NODES:
            self._spawn(["slurmd", "-D", "-N", n, "-f", str(self.conf)], f"slurmd-{n}.out")
        self._wait(self._nodes_idle, "both nodes idle", 90)
        return self

    def __enter__(self) -> "SlurmCluster":
        try:
            return self.start()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc) -> None:
        self.stop()

    def stop(self) -> None:
        """Cancels every job, then stops the daemons (slurmd first, munged last)."""
        if self.conf.exists() and any(p.poll() is None for p in self.procs):
            subprocess.run(["scancel", "--full", "--quiet", "--user", "root"], env=self.env, timeout=30,
                           capture_output=True)
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline and self.squeue():
                time.sleep(0.5)
        for p in reversed(self.procs):
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
        for p in reversed(self.procs):
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
        self.procs.clear()

    def _spawn(self, cmd: list[str], log: str) -> None:
        # Own process group, so stop() never signals anything but this daemon and its children.
        self.procs.append(subprocess.Popen(cmd, stdout=open(self.dir / log, "w"), stderr=subprocess.STDOUT,
                                           stdin=subprocess.DEVNULL, env=self.env, start_new_session=True))

    def _wait(self, predicate, what: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for p in self.procs:
                if p.poll() is not None:
                    raise RuntimeError(f"{p.args[0]} exited with {p.returncode} while waiting for {what}:\n"
                                       f"{self.logs()}")
            if predicate():
                return
            time.sleep(0.5)
        raise TimeoutError(f"Slurm test cluster: no {what} after {timeout:.0f}s:\n{self.logs()}")

    def _nodes_idle(self) -> bool:
        r = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %t"], env=self.env, capture_output=True, text=True)
        states = dict(line.split() for line in r.stdout.splitlines() if line.strip())
        return r.returncode == 0 and all(states.get(n) == "idle" for n in NODES)

    def logs(self, tail: int = 2000) -> str:
        out = []
        for f in sorted(self.dir.glob("*.log")) + sorted(self.dir.glob("*.out")):
            out.append(f"--- {f.name}\n{f.read_text(errors='replace')[-tail:]}")
        return "\n".join(out)

    # ---- client helpers ----
    def run(self, cmd: list[str], cwd: Optional[Path] = None, env: Optional[dict] = None) -> str:
        r = subprocess.run(cmd, env={**self.env, **(env or {})}, cwd=cwd, capture_output=True, text=True, timeout=60)
        if r.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed ({r.returncode}): {r.stderr or r.stdout}")
        return r.stdout

    def sbatch(self, args: list[str], cwd: Path, env: Optional[dict] = None) -> int:
        return int(self.run(["sbatch", "--parsable", *args], cwd=cwd, env=env).strip().split(";")[0])

    def squeue(self) -> list[str]:
        r = subprocess.run(["squeue", "-h", "-o", "%i %T"], env=self.env, capture_output=True, text=True)
        return [line for line in r.stdout.splitlines() if line.strip()]

    def job(self, job_id: int | str) -> dict[str, str]:
        """`scontrol show job` fields of one job (or the first task of an array)."""
        return self.jobs(job_id)[0]

    def jobs(self, job_id: int | str) -> list[dict[str, str]]:
        """`scontrol show job` fields, one dict per job (array tasks are separate jobs)."""
        out = self.run(["scontrol", "show", "job", "-o", str(job_id)])
        records = []
        for line in out.splitlines():
            fields: dict[str, str] = {}
            for token in line.split():
                k, sep, v = token.partition("=")
                if sep:
                    fields[k] = v
            if fields:
                records.append(fields)
        return records

    def wait_done(self, job_ids: list[int], timeout: float = 300) -> None:
        """Blocks until none of `job_ids` (or their array tasks) is pending, running or requeued."""
        deadline = time.monotonic() + timeout
        ids = {str(j) for j in job_ids}
        while time.monotonic() < deadline:
            live = [line for line in self.squeue() if line.split()[0].split("_")[0] in ids]
            if not live:
                return
            time.sleep(1)
        raise TimeoutError(f"jobs {sorted(ids)} still queued after {timeout:.0f}s: {self.squeue()}\n{self.logs()}")
