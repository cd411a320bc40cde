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
holds it, for the message the next run gets.
"""

from __future__ import annotations

import datetime
import errno
import fcntl
import getpass
import json
import os
import socket
from pathlib import Path
from typing import Any

from shardgen.errors import ShardgenError

LOCK_NAME = ".shardgen-run.lock"


class OutputInUse(ShardgenError):
    """Another run holds the output directory."""


class RunLock:
    """Held by a running workflow's controller; ``release`` (or the process ending) frees it."""

    def __init__(self, fd: int, path: Path) -> None:
        self._fd = fd
        self.path = path

    @classmethod
    def acquire(cls, out_dir: str | Path, workdir: str | Path, config_fingerprint: str) -> RunLock:
        """Take the lock of ``out_dir``, or say which run has it.

        Raises:
            OutputInUse: another process holds it; the message names its host,
                process, user, working directory and start time.
        """
        path = Path(out_dir) / LOCK_NAME
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o666)
        try:
            fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            os.close(fd)
            if e.errno not in (errno.EACCES, errno.EAGAIN):
                raise OutputInUse(
                    f"output.dir: cannot lock '{path}' ({e.strerror}); this file system may not support locks. "
                    "Make sure no other run uses this output directory"
                ) from e
            raise OutputInUse(
                f"output.dir '{out_dir}' is in use by another run ({describe(read_owner(path))}); two runs in one "
                "output directory would take each other's checkpoints. Wait for it to finish, or give this run "
                "another output.dir"
            ) from None
        owner = {
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "user": getpass.getuser(),
            "workdir": str(Path(workdir).absolute()),
            "config_fingerprint": config_fingerprint,
            "started": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        }
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(owner) + "\n").encode(), 0)
        return cls(fd, path)

    def release(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)  # closing drops the lock; the file stays, naming the last run
            self._fd = -1


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
