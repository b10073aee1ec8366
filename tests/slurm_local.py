"""A real single-node SLURM cluster on localhost (Debian's slurm-wlm and munge), for the profile's integration test.

`local_slurm(folder)` starts munged, slurmctld and slurmd as plain background processes bound to loopback, with
every state and log file under `folder` and their sockets (munge's, slurmd's spool) in a short folder of their own
under /tmp, and stops them all on exit. It raises `Unavailable`
(with the reason) when this machine cannot host one: not root, packages missing, ports taken, or a
`/etc/slurm/slurm.conf` that belongs to a real cluster.

Settings that make a one-node cluster work here (measured on Debian slurm 22.05.8):
- Sockets apart from `folder`: a Unix socket's path has at most 108 bytes, and slurmstepd's in the spool
  (`localhost_<job>.4294967291`) passed that under pytest-xdist's longer temp paths, so every job was requeued.
- `proctrack/linuxproc` and `task/none`: no cgroups needed; `select/cons_tres` with cores and memory as resources.
- `NoCtldInAddrAny,NoInAddrAny`: daemons listen on loopback only.
- `/etc/slurm/slurm.conf` must exist: the executor's jobstep plugin clears `SLURM_CONF` inside jobs.
- No slurmdbd, so no `sacct`: the profile is run with `slurm-status-command: squeue`, and `MinJobAge=3600`
  keeps every finished job visible to squeue/scontrol for longer than the whole test may run (1500 s): the
  test counts them at the end. 300 s was too short on a loaded CI machine, where the first jobs had been
  purged before the last one ended.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

SYSTEM_CONF = Path("/etc/slurm/slurm.conf")
MARKER = "# written by kvlab's tests/slurm_local.py; removed when the test cluster stops"
PARTITION = "kvlab"
PORTS = (16817, 16818)  # slurmctld, slurmd: away from a real cluster's 6817/6818
DAEMONS = ("munged", "slurmctld", "slurmd")
CLIENTS = ("sbatch", "squeue", "scontrol", "sinfo", "scancel", "srun")


class Unavailable(RuntimeError):
    """This machine cannot host the test cluster; the message says why."""


def _check_machine() -> None:
    if os.geteuid() != 0:
        raise Unavailable("needs root (slurmd runs jobs as their user and munged guards a root-owned key)")
    missing = [b for b in DAEMONS + CLIENTS if shutil.which(b) is None and not Path("/usr/sbin", b).exists()]
    if missing:
        raise Unavailable(f"SLURM is not installed (missing {', '.join(missing)}); apt-get install slurm-wlm munge")
    if SYSTEM_CONF.exists() and MARKER not in SYSTEM_CONF.read_text():
        raise Unavailable(f"{SYSTEM_CONF} belongs to a real cluster; not replacing it")
    for port in PORTS:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                raise Unavailable(f"port {port} on localhost is taken")


def _conf(root: Path, sockets: Path) -> str:
    # Memory is a scheduling number only here (no cgroups enforce it): at least the largest request of a rule.
    mem_mb = max(int(int(Path("/proc/meminfo").read_text().split()[1]) / 1024 * 0.9), 16000)  # MemTotal, first line
    lines = [
        MARKER,
        "ClusterName=kvlab-test",
        "SlurmctldHost=localhost(127.0.0.1)",
        f"SlurmctldPort={PORTS[0]}",
        f"SlurmdPort={PORTS[1]}",
        "CommunicationParameters=NoCtldInAddrAny,NoInAddrAny",
        "AuthType=auth/munge",
        "CredType=cred/munge",
        f"AuthInfo=socket={sockets}/munge/munge.socket",
        "SlurmUser=root",
        "SlurmdUser=root",
        "ProctrackType=proctrack/linuxproc",
        "TaskPlugin=task/none",
        "SelectType=select/cons_tres",
        "SelectTypeParameters=CR_Core_Memory",
        "JobAcctGatherType=jobacct_gather/none",
        "AccountingStorageType=accounting_storage/none",
        "MpiDefault=none",
        "ReturnToService=2",
        "MinJobAge=3600",
        "SchedulerType=sched/backfill",
        f"StateSaveLocation={root}/state",
        f"SlurmdSpoolDir={sockets}/spool",
        f"SlurmctldPidFile={root}/slurmctld.pid",
        f"SlurmdPidFile={root}/slurmd.pid",
        f"SlurmctldLogFile={root}/slurmctld.log",
        f"SlurmdLogFile={root}/slurmd.log",
        f"NodeName=localhost NodeAddr=127.0.0.1 CPUs={os.cpu_count()} RealMemory={mem_mb} State=UNKNOWN",
        f"PartitionName={PARTITION} Nodes=localhost Default=YES MaxTime=INFINITE State=UP",
    ]
    return "\n".join(lines) + "\n"


def _wait(what: str, ready, timeout: float, logs: list[Path]) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if ready():
            return
        time.sleep(0.5)
    tails = "\n".join(f"--- {p}\n{p.read_text()[-1500:]}" for p in logs if p.exists())
    raise RuntimeError(f"test SLURM: {what} not ready after {timeout:.0f} s\n{tails}")


@contextlib.contextmanager
def local_slurm(folder: Path) -> Iterator[dict[str, str]]:
    """Start the cluster under `folder`; yields the environment for SLURM's clients (SLURM_CONF)."""
    _check_machine()
    root = Path(folder).resolve()
    sockets = Path(tempfile.mkdtemp(prefix="kvlab-slurm-"))
    sockets.chmod(0o755)
    for where, sub, mode in ((sockets, "munge", 0o755), (root, "munge-key", 0o700), (root, "state", 0o755),
                             (sockets, "spool", 0o755)):
        (where / sub).mkdir(parents=True, exist_ok=True)
        (where / sub).chmod(mode)  # munged refuses a key folder others can read and a socket folder others cannot
    key = root / "munge-key" / "munge.key"
    key.write_bytes(secrets.token_bytes(128))
    key.chmod(0o600)
    conf = root / "slurm.conf"
    conf.write_text(_conf(root, sockets))
    env = {**os.environ, "SLURM_CONF": str(conf)}
    procs: list[subprocess.Popen] = []
    wrote_system_conf = False
    try:
        SYSTEM_CONF.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(conf, SYSTEM_CONF)
        wrote_system_conf = True
        munge_socket = sockets / "munge" / "munge.socket"
        procs.append(subprocess.Popen(
            ["munged", "--foreground", "--force", f"--key-file={key}", f"--socket={munge_socket}",
             f"--pid-file={sockets}/munge/munged.pid", f"--log-file={root}/munged.log", f"--seed-file={root}/munged.seed"],
            stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, env=env))
        _wait("munged", munge_socket.exists, 20, [root / "munged.log"])
        procs.append(subprocess.Popen(["slurmctld", "-D", "-i", "-f", str(conf)], stdout=subprocess.DEVNULL,
                                      stderr=subprocess.STDOUT, env=env))
        procs.append(subprocess.Popen(["slurmd", "-D", "-N", "localhost", "-f", str(conf)], stdout=subprocess.DEVNULL,
                                      stderr=subprocess.STDOUT, env=env))

        def idle() -> bool:
            out = subprocess.run(["sinfo", "-h", "-o", "%T"], capture_output=True, text=True, env=env)
            return out.returncode == 0 and out.stdout.strip() == "idle"

        _wait("the node", idle, 60, [root / "slurmctld.log", root / "slurmd.log"])
        yield env
    finally:
        subprocess.run(["scancel", "--full", "--partition", PARTITION], capture_output=True, env=env)
        for proc in reversed(procs):
            proc.terminate()
        for proc in reversed(procs):
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if wrote_system_conf:
            SYSTEM_CONF.unlink(missing_ok=True)
        shutil.rmtree(sockets, ignore_errors=True)


def jobs(env: dict[str, str]) -> list[dict[str, str]]:
    """Every job the controller still knows (finished ones stay MinJobAge seconds): id, name, state, exit code,
    partition and comment (the executor plugin writes the rule and wildcards there)."""
    out = subprocess.run(["scontrol", "show", "job", "--oneliner"], capture_output=True, text=True, env=env, check=True)
    rows = []
    for line in out.stdout.splitlines():
        fields = dict(f.split("=", 1) for f in line.split() if "=" in f)
        if "JobId" in fields:
            rows.append({k: fields.get(k, "") for k in ("JobId", "JobName", "JobState", "ExitCode", "Partition", "Comment")})
    return rows
