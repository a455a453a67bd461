"""A real one-node SLURM cluster on 127.0.0.1 for tests, started by the test session itself.

Usage (the fixture is named `slurm_cluster`; importing it as `slurm_cluster_fixture` keeps ruff from
reporting F811 on the test's argument; `from slurm_helpers import slurm_cluster` works too)::

    from slurm_helpers import slurm_cluster_fixture  # noqa: F401 (fixture `slurm_cluster`)

    def test_x(slurm_cluster, tmp_path):
        job_id = slurm_cluster.sbatch(tmp_path / "job.sh")
        info = slurm_cluster.wait_for_state(job_id, "COMPLETED", timeout=60)
        assert info["ExitCode"] == "0:0"

`start_slurm_cluster()` is the same cluster as a context manager, also usable outside pytest::

    import sys, time; sys.path.insert(0, "tests"); import slurm_helpers
    with slurm_helpers.start_slurm_cluster() as c:  # then: SLURM_CONF=... sbatch/squeue in a shell
        print(c.env["SLURM_CONF"]); time.sleep(3600)

Everything lives in one temporary directory (config, munge key and socket, state, spool, logs);
nothing is written under /etc. Installing the Debian packages (`slurm-wlm`, `munge`) does create
/etc/munge/munge.key and systemd unit links, but nothing here uses them, and the packages' own
daemons are not started in a container (policy-rc.d) and would not interfere if they were: this
cluster uses its own munge socket and its own ports.

Slurm 22.05 (Debian 12) specifics that matter:

* a requeued batch job is held (`Reason=BeginTime`) for `AuthInfo=cred_expire` seconds (default 120,
  minimum 5) before it may run again, so that the old run's job credential has expired on the node.
  We set `cred_expire=5`; the scheduler then picks the job up within `sched_interval`/`bf_interval`.
* there is no slurmdbd, so `sacct` only works with `-c` (`--completion`), reading the jobcomp/filetxt log.
* with `CommunicationParameters=NoCtldInAddrAny,NoInAddrAny` slurmctld, slurmd and srun bind to the
  address the host name resolves to instead of 0.0.0.0 (and fail if it does not resolve), so that is
  set only when the host name resolves to loopback (here: 127.0.0.1); otherwise they listen on all
  addresses, though everything is still addressed as 127.0.0.1 (SlurmctldHost, NodeAddr).
* `ProctrackType=proctrack/linuxproc` (tasks and all their descendants, like proctrack/cgroup on real
  clusters, which needs a delegated cgroup tree): with proctrack/pgid, each job end waits ~3 s more
  (slurmstepd polls the process group with 1 s, 2 s back-off) and a requeue spends ~4-8 s COMPLETING.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from cli_helpers import apt_install, free_port, skip_or_fail

SLURM_PACKAGES = ("slurm-wlm", "munge")
DAEMONS = ("munged", "slurmctld", "slurmd")
# job states after which a job does not run again by itself (REQUEUED/PREEMPTED are transient)
TERMINAL_STATES = frozenset(
    {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE"}
)
# seconds a requeued job waits before it can start again (Slurm 22.05 minimum: 5)
CRED_EXPIRE = 5


def _find(name: str) -> str | None:
    return shutil.which(name) or next(
        (p for d in ("/usr/sbin", "/usr/bin", "/sbin") if os.path.exists(p := f"{d}/{name}")), None
    )


def slurm_binaries() -> dict[str, str]:
    """Paths of munged, slurmctld and slurmd, installing the Debian packages here if missing."""
    present = lambda: all(_find(name) for name in (*DAEMONS, "sbatch"))  # noqa: E731
    apt_install(list(SLURM_PACKAGES), present=present, timeout=600)
    found = {name: _find(name) for name in DAEMONS}
    missing = [name for name, path in found.items() if path is None]
    if missing or not _find("sbatch"):
        skip_or_fail(f"installed {' '.join(SLURM_PACKAGES)} but still missing: {missing or ['sbatch']}")
    return found


def _tail(path: Path, chars: int = 3000) -> str:
    try:
        return path.read_text(errors="replace")[-chars:]
    except OSError as e:
        return f"<{e}>"


def parse_scontrol(text: str) -> dict[str, str]:
    """`scontrol show job -o` output (`Key=value Key=value ...`; values may hold spaces) as a dict."""
    fields: dict[str, str] = {}
    # a field starts at a `Key=` that begins the line or follows a space; keys look like
    # JobId, Socks/Node, NtasksPerN:B:S:C, ...; values run up to the next such key
    for match in re.finditer(
        r"(?:^|(?<=\s))([A-Za-z][\w:/]*)=(.*?)(?=\s+[A-Za-z][\w:/]*=|\s*$)", text.strip()
    ):
        fields.setdefault(match.group(1), match.group(2))
    return fields


@dataclass
class SlurmCluster:
    """A running one-node cluster. `env` is the environment for sbatch/squeue/scontrol/scancel/sacct."""

    root: Path
    env: dict[str, str]
    node: str
    cpus: int
    conf: Path
    logs: dict[str, Path] = field(default_factory=dict)

    def run(self, *cmd: str, check: bool = True, timeout: float = 60) -> subprocess.CompletedProcess:
        """Run a Slurm client command (`run("squeue", "-h")`) against this cluster; text output."""
        proc = subprocess.run(list(cmd), env=self.env, capture_output=True, text=True, timeout=timeout)
        if check and proc.returncode != 0:
            output = f"{proc.stdout}\n{proc.stderr}\n{self.log_tails()}"
            raise AssertionError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{output}")
        return proc

    def sbatch(self, script: str | os.PathLike, *args: str, cwd: str | os.PathLike | None = None) -> str:
        """Submit a batch script; returns the job id. `args` go before the script (`--ntasks=2`)."""
        cmd = ["sbatch", "--parsable", *args, str(script)]
        proc = subprocess.run(cmd, env=self.env, capture_output=True, text=True, timeout=60, cwd=cwd)
        if proc.returncode != 0:
            raise AssertionError(f"sbatch failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
        return proc.stdout.strip().split(";")[0]

    def job_info(self, job_id: str | int) -> dict[str, str]:
        """Parsed `scontrol show job` fields (JobState, Reason, Restarts, ExitCode, ...); {} once purged."""
        proc = self.run("scontrol", "show", "job", "-o", str(job_id), check=False)
        if proc.returncode != 0:
            if "Invalid job id" in proc.stderr:
                return {}
            raise AssertionError(f"scontrol show job {job_id} failed:\n{proc.stderr}")
        # a job array or het job prints one line per component; the first is the job itself
        lines = proc.stdout.strip().splitlines()
        return parse_scontrol(lines[0]) if lines else {}

    def wait_for_state(
        self, job_id: str | int, states: str | Iterable[str], timeout: float = 60, interval: float = 0.25
    ) -> dict[str, str]:
        """Poll until the job's JobState is one of `states`; returns its job_info.

        Fails at once if the job reaches a terminal state (COMPLETED, FAILED, ...) it was not waited
        for, and after `timeout` seconds; both failures show the job and the daemon log tails."""
        wanted = {states} if isinstance(states, str) else set(states)
        deadline = time.monotonic() + timeout
        info: dict[str, str] = {}
        while True:
            info = self.job_info(job_id)
            state = info.get("JobState", "")
            if state in wanted:
                return info
            if state in TERMINAL_STATES - wanted:
                pytest.fail(
                    f"job {job_id} ended {state} while waiting for {sorted(wanted)}: {info}\n"
                    f"{self._job_output(info)}"
                )
            if time.monotonic() > deadline:
                pytest.fail(
                    f"job {job_id} not in {sorted(wanted)} after {timeout}s: {info}\n"
                    f"{self._job_output(info)}\n{self.log_tails()}"
                )
            time.sleep(interval)

    def _job_output(self, info: dict[str, str]) -> str:
        out = info.get("StdOut")
        return f"--- job output ({out}) ---\n{_tail(Path(out))}" if out and os.path.exists(out) else ""

    def jobs(self) -> list[str]:
        """Ids of the jobs slurmctld still knows about that have not finished."""
        proc = self.run("squeue", "-h", "-o", "%i", check=False)
        return proc.stdout.split() if proc.returncode == 0 else []

    def log_tails(self, chars: int = 2000) -> str:
        """The end of each daemon's log, for failure messages."""
        return "\n".join(
            f"--- {name} log ({path}) ---\n{_tail(path, chars)}"
            for name, path in self.logs.items()
            if path.exists()
        )


def _loopback_hostname() -> bool:
    """True when this host's name resolves only to loopback addresses (so srun binds to 127.0.0.1 too)."""
    try:
        addresses = {info[4][0] for info in socket.getaddrinfo(socket.gethostname(), None, socket.AF_INET)}
    except OSError:
        return False
    return bool(addresses) and all(a.startswith("127.") for a in addresses)


def _slurm_conf(root: Path, node: str, cpus: int, ctld_port: int, slurmd_port: int) -> str:
    # NoCtldInAddrAny/NoInAddrAny: slurmctld, slurmd and srun bind to what the host name resolves to
    # instead of 0.0.0.0; only right when that is loopback (NodeAddr and SlurmctldHost are 127.0.0.1)
    comm = "CommunicationParameters=NoCtldInAddrAny,NoInAddrAny" if _loopback_hostname() else ""
    return f"""\
ClusterName=sslvittest
SlurmctldHost={node}(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
{comm}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
# socket: our own munged; cred_expire: also how long a requeued job is held (Reason=BeginTime)
# before it may start again (default 120 s, minimum 5)
AuthInfo=socket={root}/munge/munge.socket,cred_expire={CRED_EXPIRE}
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool/slurmd-%n
SlurmctldPidFile={root}/run/slurmctld.pid
SlurmdPidFile={root}/run/slurmd-%n.pid
SlurmctldLogFile={root}/log/slurmctld.log
SlurmdLogFile={root}/log/slurmd.log
SlurmctldDebug=info
SlurmdDebug=info
PlugStackConfig={root}/plugstack.conf
# no cgroup delegation in containers: track each task and its descendants through /proc, so signals
# reach forked children too, as with proctrack/cgroup (proctrack/pgid made every job end ~3 s slower)
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SwitchType=switch/none
MpiDefault=none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
# no slurmdbd: `sacct -c` reads finished jobs from this file
JobCompType=jobcomp/filetxt
JobCompLoc={root}/log/jobcomp.log
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/backfill
# look for startable jobs every second (the default 60/30 s would delay requeued jobs that long)
SchedulerParameters=sched_interval=1,bf_interval=1
JobRequeue=1
ReturnToService=2
KillWait=2
MinJobAge=600
InactiveLimit=0
MessageTimeout=10
SlurmctldTimeout=30
SlurmdTimeout=60
# use the node as configured (CPUs=nproc) even if slurmd counts the hardware differently
SlurmdParameters=config_overrides
NodeName={node} NodeAddr=127.0.0.1 NodeHostname={node} CPUs={cpus} State=UNKNOWN
PartitionName=debug Nodes={node} Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO
"""


def _stop(proc: subprocess.Popen, timeout: float = 10) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout)


@contextlib.contextmanager
def start_slurm_cluster(
    root: str | os.PathLike | None = None, options: dict[str, str] | None = None, timeout: float = 60
) -> Iterator[SlurmCluster]:
    """Start munged, slurmctld and slurmd for a one-node cluster on 127.0.0.1; stop them on exit.

    `root` (default: a fresh directory under /tmp, removed afterwards) holds all config and state;
    `options` replace or add slurm.conf settings (`{"KillWait": "5"}`).
    munged insists that every directory above its socket be executable by all (`/tmp/pytest-of-root`
    is 0700) and the socket path must stay under ~100 characters, hence /tmp rather than pytest's tmp."""
    if os.geteuid() != 0:
        skip_or_fail("the slurm test cluster needs root (SlurmUser=root, munged, slurmd)")
    binaries = slurm_binaries()
    own_root = root is None
    root = Path(tempfile.mkdtemp(prefix="slurm-", dir="/tmp") if own_root else root).resolve()
    root.mkdir(parents=True, exist_ok=True)
    root.chmod(0o711)
    for sub in ("state", "spool", "run", "log"):
        (root / sub).mkdir(parents=True, exist_ok=True)
    (root / "munge").mkdir(mode=0o755, exist_ok=True)  # munged: socket dir must be world-executable
    key = root / "munge" / "munge.key"
    if not key.exists():
        key.write_bytes(os.urandom(1024))
    key.chmod(0o400)  # munged: key readable by its owner only
    (root / "plugstack.conf").write_text("")  # not /etc/slurm/plugstack.conf (Debian's SPANK plugins)

    node = socket.gethostname().split(".")[0]
    if not re.fullmatch(r"[A-Za-z0-9_-]+", node):
        node = "localnode"
    cpus = os.cpu_count() or 1
    with contextlib.suppress(AttributeError):
        cpus = len(os.sched_getaffinity(0))  # what `nproc` prints
    conf = root / "slurm.conf"
    text = _slurm_conf(root, node, cpus, free_port(), free_port())
    for option, value in (options or {}).items():
        line = f"{option}={value}"
        text, found = re.subn(rf"(?m)^{re.escape(option)}=.*$", lambda _, line=line: line, text)
        if not found:
            text = f"{line}\n{text}"  # before the NodeName/PartitionName lines
    conf.write_text(text)

    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(
            ("SLURM_", "SLURMD_", "SBATCH_", "SRUN_", "SALLOC_", "SQUEUE_", "SINFO_", "SACCT_", "SCONTROL_")
        )
    }
    env["SLURM_CONF"] = str(conf)
    logs = {
        "munged": root / "log" / "munged.out",  # in --foreground munged logs to stderr
        "slurmctld": root / "log" / "slurmctld.log",
        "slurmctld stderr": root / "log" / "slurmctld.out",  # errors before the log file is open
        "slurmd": root / "log" / "slurmd.log",
        "slurmd stderr": root / "log" / "slurmd.out",
    }
    cluster = SlurmCluster(root=root, env=env, node=node, cpus=cpus, conf=conf, logs=logs)
    commands = {
        "munged": [
            binaries["munged"],
            "--foreground",
            f"--socket={root}/munge/munge.socket",
            f"--key-file={key}",
            f"--pid-file={root}/run/munged.pid",
            f"--seed-file={root}/munge/munged.seed",
        ],
        "slurmctld": [binaries["slurmctld"], "-D", "-f", str(conf)],
        "slurmd": [binaries["slurmd"], "-D", "-f", str(conf), "-N", node],
    }
    procs: dict[str, subprocess.Popen] = {}
    try:
        for name, cmd in commands.items():
            with open(root / "log" / f"{name}.out", "ab") as out:
                procs[name] = subprocess.Popen(
                    cmd,
                    env=env,
                    stdin=subprocess.DEVNULL,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            if name == "munged":
                _wait_for(
                    lambda: (root / "munge" / "munge.socket").exists(),
                    procs,
                    cluster,
                    "munged socket",
                    timeout,
                )
            elif name == "slurmctld":
                _wait_for(
                    lambda: cluster.run("scontrol", "ping", check=False).stdout.count("UP") > 0,
                    procs,
                    cluster,
                    "slurmctld to answer `scontrol ping`",
                    timeout,
                )
        _wait_for(
            lambda: _node_state(cluster) == "idle", procs, cluster, f"node {node} idle in sinfo", timeout
        )
        yield cluster
    finally:
        with contextlib.suppress(Exception):
            if "slurmctld" in procs and procs["slurmctld"].poll() is None:
                _cancel_all(cluster)
        for name in reversed(list(procs)):
            _stop(procs[name])
        if own_root:
            shutil.rmtree(root, ignore_errors=True)


def _node_state(cluster: SlurmCluster) -> str:
    proc = cluster.run("sinfo", "-h", "-N", "-n", cluster.node, "-o", "%T", check=False)
    return proc.stdout.strip().rstrip("*~#!%$@^-") if proc.returncode == 0 else ""


def _wait_for(
    ready, procs: dict[str, subprocess.Popen], cluster: SlurmCluster, what: str, timeout: float
) -> None:
    deadline = time.monotonic() + timeout
    while not ready():
        dead = {name: p.returncode for name, p in procs.items() if p.poll() is not None}
        if dead:
            pytest.fail(f"slurm test cluster: {dead} exited while waiting for {what}\n{cluster.log_tails()}")
        if time.monotonic() > deadline:
            pytest.fail(f"slurm test cluster: no {what} after {timeout}s\n{cluster.log_tails()}")
        time.sleep(0.2)


def _cancel_all(cluster: SlurmCluster, timeout: float = 30) -> None:
    """Cancel every job and wait until they are gone: slurmd leaves running steps behind when stopped."""
    jobs = cluster.jobs()
    if not jobs:
        return
    cluster.run("scancel", *jobs, check=False)
    deadline = time.monotonic() + timeout
    while cluster.jobs() and time.monotonic() < deadline:
        time.sleep(0.5)


@pytest.fixture(scope="session", name="slurm_cluster")
def slurm_cluster_fixture() -> Iterator[SlurmCluster]:
    """A one-node SLURM cluster on 127.0.0.1 for the whole session (see the module docstring)."""
    with start_slurm_cluster() as cluster:
        yield cluster


# the same fixture under its own name; importing this one makes ruff report F811 on each test that
# takes `slurm_cluster` as an argument, so prefer `from slurm_helpers import slurm_cluster_fixture`
slurm_cluster = slurm_cluster_fixture
