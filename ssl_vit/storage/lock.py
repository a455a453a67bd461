"""One job at a time on what it writes: one `ssl-vit fit` per run directory (`RUN/fit.lock`), one
`evaluate`, `compare`, `analyze`, `export` or `data convert` per output (`ssl_vit.storage.outdir`).

Two fits in one run directory (a job requeued while its previous allocation is still draining, a command
started twice) would both see it empty or both resume it, and write config.yaml, checkpoints under the
same names and a W&B run each: the directory would hold a mix of the two, with no error. `fit` takes the
lock before it reads or writes anything in the run directory and holds it until it exits; a second fit
is refused with one line naming the holder. Two commands given one `--out` would likewise both find it
new and the second's rename would replace the first's results.

The lock file holds its holder's host, pid and command (one JSON line) and carries a POSIX record lock
(`fcntl.lockf`) of the holder's process, which the kernel (or the NFS server) drops when the process
ends, however it ends. POSIX locks rather than flock: they are not inherited by forked DataLoader
workers (which may outlive a killed trainer), and NFS arbitrates them on the server (flock on NFS is
emulated with them anyway). A holder creates its file already locked (`RunLock._create`), so a file
whose lock is free has no live holder, wherever locks are seen:

- locks seen by every host (local disks; NFS, the default `local_lock=none` with NFSv4 or lockd; Lustre
  mounted with `-o flock`): a file whose lock is free was left by a holder that ended without removing
  it (SIGKILL, a node lost), on this host or another; it is taken over with a one-line warning.
- locks seen only on the node (NFS `nolock` or `local_lock=posix|all`, Lustre `-o localflock`, BeeGFS
  without global locks, FUSE; read from /proc/self/mountinfo): the same on this host; a file naming
  another host is respected: refused, saying to delete the file if that job has ended.
- no locks (`lockf` fails with ENOLCK/ENOSYS/EOPNOTSUPP: Lustre `-o noflock`, NFSv3 without lockd): the
  file is created atomically (link(2), atomic on NFS too); one naming a process of this host that no
  longer exists is taken over (`_host_mutex`), one naming another host is respected.

Only the process of a job that is global rank 0 by its launcher's environment takes the lock
(`job_leader`): under torchrun, srun or Lightning's own launcher every rank runs the command.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import os
import re
import socket
import struct
import tempfile
import time
from contextlib import contextmanager
from datetime import datetime, timezone
from pathlib import Path

from ssl_vit.errors import UserError, warn
from ssl_vit.storage.atomic import Staged

LOCK_NAME = "fit.lock"
HOST = socket.gethostname()
# lockf on a file another process has locked; and on filesystems without POSIX locks.
HELD = {errno.EACCES, errno.EAGAIN}
NO_LOCKS = {errno.ENOLCK, errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EINVAL}
# Where launchers put a process's rank: torchrun (RANK, LOCAL_RANK, GROUP_RANK), Lightning's launcher
# (LOCAL_RANK, NODE_RANK), SLURM (SLURM_PROCID), LSF (JSM_NAMESPACE_RANK), MPI (OMPI_COMM_WORLD_RANK,
# PMI_RANK). SLURM_PROCID stays 0 in processes a launcher starts inside one SLURM task; the others
# tell those apart.
RANK_VARIABLES = (
    "RANK", "LOCAL_RANK", "GROUP_RANK", "NODE_RANK", "SLURM_PROCID", "JSM_NAMESPACE_RANK",
    "OMPI_COMM_WORLD_RANK", "PMI_RANK",
)  # fmt: skip
ATTEMPTS = 20  # rounds of look-then-take; another process must change the file in between to need two
_holding: list[RunLock] = []  # the locks this process holds (`release_all`)


def release_all() -> None:
    """Release every run directory lock this process holds: before `scontrol requeue`, after which SLURM
    may kill the job before it exits (the requeued job, perhaps on another node, would find the lock left
    behind)."""
    for lock in list(_holding):
        lock.release()


def job_leader(environ=os.environ) -> bool:
    """Whether this process locks its job's run directory: every rank variable a launcher set is 0.
    Not the trainer's global rank: the lock is taken before the trainer (or the process group) exists."""
    for name in RANK_VARIABLES:
        value = environ.get(name, "").strip()
        if value.lstrip("-").isdigit() and int(value) != 0:
            return False
    return True


class RunLock:
    """`with RunLock(run_dir):` holds `run_dir/fit.lock` (creating `run_dir` if needed) or raises a one-line
    UserError naming its holder; on exit it removes the file, and the directories it created if they
    stayed empty.

    Another command's lock: `name`, the lock file's name in `run_dir`; `command`, the ssl-vit command
    that holds it (the holder's description); `subject`, what the lock keeps to one job in the messages
    (default: `run_dir`); `rule` and `alternative`, what a refusal says (one job per what, and the other
    place to give)."""

    def __init__(
        self,
        run_dir: str | os.PathLike,
        name: str = LOCK_NAME,
        command: str = "fit",
        subject: str | None = None,
        rule: str = "one fit per run directory",
        alternative: str = "give another --trainer.default_root_dir",
    ) -> None:
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / name
        self.command, self.subject = command, subject or str(self.run_dir)
        self.rule, self.alternative = rule, alternative
        self._fd: int | None = None
        self._created: list[Path] = []
        self._locks: bool | None = True  # what lockf said on the last file looked at (None: no locks)

    @property
    def made_run_dir(self) -> bool:
        """Whether taking the lock made the run directory (it did not exist before)."""
        return self.run_dir in self._created

    def __enter__(self) -> RunLock:
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()

    def acquire(self) -> None:
        try:
            self._created = _makedirs(self.run_dir)
            for _ in range(ATTEMPTS):
                if self._attempt():
                    return
                time.sleep(0.05)  # another process is taking or releasing it: look again
            raise UserError(
                f"{self.path} kept changing while this {self.command} tried to take it: another ssl-vit job "
                f"is starting on {self.subject}; start this one again once that one runs"
            )
        except BaseException as err:
            self._remove_created()
            if isinstance(err, OSError):
                why = f"{type(err).__name__}: {err.strerror or err}"
                raise UserError(
                    f"cannot lock {self.subject} ({why}, lock {self.path}): {self.alternative} this user can "
                    "create and write"
                ) from None
            raise

    def release(self) -> None:
        if self._fd is None:
            return
        fd, self._fd = self._fd, None
        _holding.remove(self)
        try:
            if _same_file(fd, self.path):  # never the file of a process that took it over
                os.unlink(self.path)
        except OSError:  # the run directory was removed or is unreachable: nothing left to unlock
            pass
        finally:
            os.close(fd)  # drops the POSIX lock (after the unlink: see _judge)
        self._remove_created()

    # --- taking it ---------------------------------------------------------------------------------

    def _attempt(self) -> bool:
        """One look at the lock file and one try to take it: True when held, False to look again."""
        try:
            fd = os.open(self.path, os.O_RDWR)
        except FileNotFoundError:
            return self._create(replace=None)
        try:
            stale = self._judge(fd)  # raises the refusal when it is held
            if stale is None:
                return False
            if self._locks is None:
                # Without locks nothing stops two processes of this host from replacing the same stale
                # file at once: they take turns here, and the second finds the first one's file.
                with _host_mutex(self.path):
                    unchanged = _same_file(fd, self.path) and (_read(fd) or {}) == stale
                    taken = unchanged and self._create(replace=fd)
            else:  # this process holds the stale file's lock: any other taker waits for it
                taken = self._create(replace=fd)
            if taken:
                what = f"from {_describe(stale)}, which ended" if stale else "(it names no holder)"
                warn(f"took over the lock {self.path} {what} without releasing it")
            return taken
        finally:
            os.close(fd)

    def _judge(self, fd: int) -> dict | None:
        """The holder recorded in the open lock file `fd` when it has none any more (stale: {} if the
        file is unreadable), with its lock held by this process; None when the file changed meanwhile.
        A UserError naming the holder when it still holds it, or when that cannot be told."""
        holder = _read(fd)
        if holder and holder.get("host") == HOST and holder.get("pid") == os.getpid():
            # Before lockf: this process's own lock would not stop it, and closing `fd` would drop it.
            raise UserError(f"{self.path} is held by this process already: a job takes its lock once")
        locks = self._locks = _try_lock(fd)
        if locks is False:
            if holder and holder.get("host") == HOST and not alive(holder.get("pid")):
                return None  # being taken over from its dead holder by another process right now
            raise self._held(holder)
        if not _same_file(fd, self.path):
            return None  # removed or replaced since it was opened (released, or taken over)
        other_host = bool(holder) and holder.get("host") != HOST
        if locks is None or other_host:
            # Without locks, or with locks only this node sees: a holder elsewhere cannot be checked;
            # one here is checked by its pid.
            local_only = "its filesystem has no locks" if locks is None else _node_local_locks(self.run_dir)
            if other_host and local_only:
                raise self._held(holder, unverifiable=local_only)
            if not other_host and holder and alive(holder.get("pid")):
                raise self._held(holder)
        return holder or {}

    def _create(self, replace: int | None) -> bool:
        """Put a new lock file of this process in place, locked before it appears: linked if there is
        none (`replace` None; False if another process made one first), else renamed over the stale
        file open as `replace`, whose lock this process holds while it does so."""
        with Staged(self.path, mode=0o644) as staged:
            fd = staged.create()
            record = {
                "host": HOST,
                "pid": os.getpid(),
                "since": datetime.now(timezone.utc).isoformat("T", "seconds"),
                "command": self.command,
            }
            os.write(fd, (json.dumps(record) + "\n").encode())
            staged.sync()
            _try_lock(fd)
            if replace is None:
                if not staged.link():
                    return False
            elif not _same_file(replace, self.path):
                return False
            else:
                staged.replace()
            self._fd = staged.keep()
            _holding.append(self)
            return True

    def _held(self, holder: dict | None, unverifiable: str | None = None) -> UserError:
        who = _describe(holder) if holder else "another ssl-vit job (starting)"
        if unverifiable:
            return UserError(
                f"{self.subject} is locked by {who}, which this host cannot check ({unverifiable}): if that "
                f"job has ended, delete {self.path} and start again, else {self.alternative}"
            )
        return UserError(
            f"{self.subject} is in use by {who} (lock {self.path}): {self.rule}; wait for it to end, or "
            f"{self.alternative}"
        )

    def _remove_created(self) -> None:
        for directory in reversed(self._created):
            try:
                os.rmdir(directory)
            except OSError:  # not empty (the fit wrote into it), or gone
                break
        self._created = []


def lock_state(run_dir: str | os.PathLike, name: str = LOCK_NAME) -> str:
    """What `run_dir`'s lock says of its holder, in a few words (for `ssl-vit status`), looking without
    taking it: the kernel is asked who holds its POSIX lock (F_GETLK), nothing is written or locked."""
    path = Path(run_dir) / name
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return "not held (no lock file)"
    except OSError as err:
        return f"unknown ({path} cannot be read: {err.strerror})"
    try:
        holder, held = _read(fd), _lock_holder(fd)
    finally:
        os.close(fd)
    who = _describe(holder) if holder else "a job that recorded no holder"
    if held is None:  # no locks here: the pid tells, on this host only
        if holder and holder.get("host") != HOST:
            return f"recorded by {who}: another host, which this one cannot check"
        held = bool(holder) and alive(holder.get("pid"))
    if held:
        return f"held by {who}, a live process"
    return f"not held: left by {who}, which has ended (killed, or its node lost)"


def _lock_holder(fd: int) -> bool | None:
    """Whether another process holds a POSIX lock on `fd`'s file (None: the filesystem cannot tell)."""
    query = struct.pack("hhqqi", fcntl.F_WRLCK, os.SEEK_SET, 0, 0, 0) + bytes(8)  # struct flock, padded
    try:
        answer = fcntl.fcntl(fd, fcntl.F_GETLK, query)
    except OSError:
        return None
    return struct.unpack_from("h", answer)[0] != fcntl.F_UNLCK


@contextmanager
def _host_mutex(path: Path):
    """Exclusive among the processes of this host, for `path` (flock on a file in the temp directory,
    which stays there: removing it would let two processes lock two different files)."""
    key = hashlib.sha1(os.path.realpath(path).encode()).hexdigest()[:16]
    fd = os.open(os.path.join(tempfile.gettempdir(), f"ssl-vit-{key}.mutex"), os.O_RDWR | os.O_CREAT, 0o666)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _try_lock(fd: int) -> bool | None:
    """Lock `fd` (POSIX, exclusive, not waiting): True; False when another process holds it; None when
    the filesystem has no locks."""
    try:
        fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except OSError as err:
        if err.errno in HELD:
            return False
        if err.errno in NO_LOCKS:
            return None
        raise


def _read(fd: int) -> dict | None:
    # pread on the open descriptor: opening the file again and closing it would drop the lock (`Staged.keep`).
    try:
        record = json.loads(os.pread(fd, 4096, 0).decode())
    except (ValueError, UnicodeDecodeError):
        return None
    return record if isinstance(record, dict) else None


def _describe(holder: dict) -> str:
    since = f", since {holder['since']}" if holder.get("since") else ""
    command = holder.get("command", "fit")  # files written before commands other than fit took locks
    return f"ssl-vit {command} on host {holder.get('host', '?')} pid {holder.get('pid', '?')}{since}"


def alive(pid) -> bool:
    """Whether a process `pid` exists on this host (a pid that was reused counts as alive: safe side)."""
    if not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def _same_file(fd: int, path: Path) -> bool:
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return False
    mine = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (mine.st_dev, mine.st_ino)


def _makedirs(directory: Path) -> list[Path]:
    """Create `directory` and its missing parents; those created, outermost first."""
    missing = []
    for path in (directory, *directory.parents):
        if path.exists():
            break
        missing.append(path)
    directory.mkdir(parents=True, exist_ok=True)
    return list(reversed(missing))


def _node_local_locks(directory: Path, mountinfo: str = "/proc/self/mountinfo") -> str | None:
    """Why POSIX locks on `directory`'s filesystem are seen only on this node (its type and mount
    options), or None when every host that mounts it sees them (or the mount table is not readable)."""
    try:
        lines = Path(mountinfo).read_text().splitlines()
    except OSError:
        return None
    target, best = os.path.realpath(directory), None
    for line in lines:
        # ID PARENT MAJ:MIN ROOT MOUNT_POINT OPTIONS [OPTIONAL...] - FSTYPE SOURCE SUPER_OPTIONS
        left, _, right = line.partition(" - ")
        fields, tail = left.split(), right.split()
        if len(fields) < 6 or not tail:
            continue
        point = re.sub(r"\\([0-7]{3})", lambda m: chr(int(m[1], 8)), fields[4])
        if target == point or target.startswith(point.rstrip("/") + "/"):
            if best is None or len(point) >= len(best[0]):
                options = set(fields[5].split(",")) | set((tail[2] if len(tail) > 2 else "").split(","))
                best = (point, tail[0], options)
    if best is None:
        return None
    _, fstype, options = best
    if fstype.startswith("nfs"):
        local = sorted(options & {"nolock", "local_lock=posix", "local_lock=all"})
        return f"{fstype} mounted with {','.join(local)}" if local else None
    if fstype == "lustre" and "localflock" in options:
        return "lustre mounted with localflock"
    if fstype == "beegfs":
        return "BeeGFS, whose locks are node-local unless tuneUseGlobalFileLocks is set"
    if fstype.startswith("fuse"):
        return f"{fstype}, a FUSE filesystem"
    return None


__all__ = ["LOCK_NAME", "RunLock", "job_leader", "release_all"]
