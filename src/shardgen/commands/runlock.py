"""One run per output directory.

Two workflow runs writing into one ``output.dir`` (from two working
directories, or two users of a shared project directory) would resume,
discard and commit each other's checkpoints. Snakemake's own lock covers one
working directory only, so the controller of a run holds a lock on
``<output.dir>/.shardgen-run.lock`` for as long as it runs (taken in the
Snakefile's ``onstart``, before any job, never by a dry run).

The lock is a POSIX record lock (``fcntl.lockf``): the kernel (or the NFS
lock manager) drops it when the controller exits, however it exits, so a
killed run leaves no stale lock behind. The file also names the run that
holds it, for the message the next run gets. It holds between nodes on local
file systems, NFS with its lock manager, GPFS, BeeGFS with global locks and
Lustre mounted with ``flock``.

Where the file system has no record locks (Lustre mounted without ``flock``
answers ENOSYS; some others ENOLCK or EOPNOTSUPP), or has locks that only the
node taking them sees (NFS mounted ``nolock`` or ``local_lock=all|posix``,
Lustre mounted ``localflock``, BeeGFS without global locks, its default: the
mount table says so, ``node_local_locks``), the run says so and also takes a
lock file created with ``O_EXCL`` (atomic on every one of them,
NFSv3 and later included): ``<output.dir>/.shardgen-run.held``, naming its
run, its modification time renewed every ``HEARTBEAT_S`` by a thread of the
controller. A killed controller leaves it behind: the next run takes it over
when its holder's process is gone (same host) or its heartbeat is older than
``LEASE_S`` by the file system's clock.
"""

from __future__ import annotations

import datetime
import errno
import fcntl
import getpass
import json
import logging
import os
import secrets
import threading
from pathlib import Path
from typing import Any

from shardgen.base import jobinfo
from shardgen.base.io import Dir
from shardgen.base.rundir import HELD_NAME, RunDir
from shardgen.errors import ShardgenError

# errno values of a file system without record locks
NO_LOCKS = (errno.ENOSYS, errno.ENOLCK, errno.EOPNOTSUPP)
HEARTBEAT_S = 30.0
LEASE_S = 300.0

log = logging.getLogger(__name__)


def node_local_locks(path: str | Path, mounts: str | None = None) -> str | None:
    """Why record locks on ``path``'s file system hold on this node only (its mount options in
    ``/proc/self/mounts``, or ``mounts``); None when they hold between nodes, or it cannot be told."""
    if mounts is None:
        try:
            mounts = Path("/proc/self/mounts").read_text()
        except OSError:
            return None
    target, best = os.path.realpath(path), None
    for line in mounts.splitlines():
        fields = line.split()
        if len(fields) < 4:
            continue
        point = fields[1].replace("\\040", " ")
        if (target == point or target.startswith(point.rstrip("/") + "/")) and (
            best is None or len(point) > len(best[1])
        ):
            best = fields
    if best is None:
        return None
    fstype, options = best[2], best[3].split(",")
    if fstype.startswith("nfs") and ("nolock" in options or {"local_lock=all", "local_lock=posix"} & set(options)):
        return f"{fstype} at {best[1]} is mounted {'nolock' if 'nolock' in options else 'with local locks'}"
    if fstype == "lustre" and "localflock" in options:
        return f"lustre at {best[1]} is mounted localflock"
    if fstype == "beegfs":
        return f"beegfs at {best[1]} keeps record locks on each node unless its clients set tuneUseGlobalFileLocks"
    return None


class OutputInUse(ShardgenError):
    """Another run holds the output directory."""


class RunLock:
    """Held by a running workflow's controller; ``release`` (or the process ending) frees it."""

    def __init__(self, fd: int, path: Path, held: _HeldFile | None = None) -> None:
        self._fd = fd
        self.path = path
        self._held = held

    @classmethod
    def acquire(cls, out_dir: str | Path, workdir: str | Path, config_fingerprint: str) -> RunLock:
        """Take the lock of ``out_dir``, or say which run has it.

        Raises:
            OutputInUse: another process holds it; the message names its host,
                process, user, working directory and start time.
        """
        run_dir = RunDir(out_dir)
        path = run_dir.lock
        path.parent.mkdir(parents=True, exist_ok=True)
        owner = _owner(workdir, config_fingerprint)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o666)
        held = None
        try:
            fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            if e.errno in NO_LOCKS:
                log.warning("shardgen: '%s' cannot be locked here (%s): this file system has no record locks; "
                            "using the lock file %s instead", path, e.strerror, HELD_NAME)  # fmt: skip
                try:
                    held = _HeldFile.acquire(run_dir.held, owner, out_dir)
                except BaseException:
                    os.close(fd)
                    raise
            else:
                os.close(fd)
                if e.errno not in (errno.EACCES, errno.EAGAIN):
                    raise OutputInUse(
                        f"output.dir: cannot lock '{path}' ({e.strerror}). Make sure no other run uses this output "
                        "directory"
                    ) from e
                raise _in_use(out_dir, read_owner(path)) from None
        local = None if held else node_local_locks(out_dir)
        if local:
            log.warning("shardgen: '%s': %s, so a run on another node would not see this lock; using the lock "
                        "file %s as well", path, local, HELD_NAME)  # fmt: skip
            try:
                held = _HeldFile.acquire(run_dir.held, owner, out_dir)
            except BaseException:
                os.close(fd)
                raise
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(owner) + "\n").encode(), 0)
        return cls(fd, path, held)

    def release(self) -> None:
        if self._held is not None:
            self._held.release()
            self._held = None
        if self._fd >= 0:
            os.close(self._fd)  # closing drops the lock; the file stays, naming the last run
            self._fd = -1


def _in_use(out_dir: str | Path, owner: dict[str, Any]) -> OutputInUse:
    return OutputInUse(
        f"output.dir '{out_dir}' is in use by another run ({describe(owner)}); two runs in one output directory "
        "would take each other's checkpoints. Wait for it to finish, or give this run another output.dir"
    )


def _owner(workdir: str | Path, config_fingerprint: str) -> dict[str, Any]:
    return {
        "host": jobinfo.host(),
        "pid": os.getpid(),
        "user": getpass.getuser(),
        "workdir": str(Path(workdir).absolute()),
        "config_fingerprint": config_fingerprint,
        "started": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "token": secrets.token_hex(8),
    }


class _HeldFile:
    """The lock where the file system has no record locks: a file created with ``O_EXCL``, its
    modification time renewed by a thread, taken over once its holder is gone (module docstring)."""

    def __init__(self, path: Path, token: str) -> None:
        self.path, self.token = path, token
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, name="shardgen-run-lock", daemon=True)
        self._thread.start()

    @classmethod
    def acquire(cls, path: Path, owner: dict[str, Any], out_dir: str | Path) -> _HeldFile:
        with Dir.open(path.parent) as d:
            for _ in range(3):
                if d.create_exclusive(path.name, (json.dumps(owner) + "\n").encode()):
                    return cls(path, owner["token"])
                held = read_owner(path)
                if not _gone(held, path):
                    raise _in_use(out_dir, held)
                log.warning("shardgen: taking over the lock file of a run that has ended (%s)", describe(held))
                if read_owner(path).get("token") == held.get("token"):  # not taken over by another run meanwhile
                    d.unlink(path.name)
        raise _in_use(out_dir, read_owner(path))

    def _beat(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            try:
                os.utime(self.path)
            except OSError as e:  # a file system hiccup: the next beat tries again
                log.warning("shardgen: renewing %s failed: %s", self.path, e)

    def release(self) -> None:
        self._stop.set()
        if read_owner(self.path).get("token") == self.token:
            self.path.unlink(missing_ok=True)


def _gone(owner: dict[str, Any], path: Path) -> bool:
    """Whether the run that holds the lock file has ended: its process, on this host, is gone, or its
    heartbeat is older than the lease by the file system's clock (a file touched now, read back)."""
    if jobinfo.process_gone(owner.get("host"), owner.get("pid")):
        return True
    clock = path.with_name(f".clock-{secrets.token_hex(4)}")
    try:
        clock.touch()
        age = clock.stat().st_mtime - path.stat().st_mtime
    except FileNotFoundError:
        return True  # released meanwhile
    finally:
        clock.unlink(missing_ok=True)
    return age > LEASE_S


def read_owner(path: str | Path) -> dict[str, Any]:
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return {}


def describe(owner: dict[str, Any]) -> str:
    if not owner:
        return "unknown"
    return (
        f"process {owner.get('pid')} of {owner.get('user')} on {owner.get('host')}, started "
        f"{owner.get('started')} in {owner.get('workdir')}"
    )


def release_run(lock: RunLock | None, watcher: Any = None) -> None:
    """The end of a run (its onsuccess and onerror): stop the watcher of its pending jobs
    (``cluster.PendingWatcher``) and release its hold on output.dir. The command line's process ends
    with the run anyway; a run from Python (``shardgen.run``) goes on in the caller's process, which may
    run again."""
    if watcher is not None:
        watcher.close()
    if lock is not None:
        lock.release()
