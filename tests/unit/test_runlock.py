"""One run per output directory: a second run is refused, naming the first; a killed run leaves no lock."""

from __future__ import annotations

import errno
import fcntl
import subprocess
import sys
import time

import pytest

from shardgen.base.rundir import HELD_NAME, LOCK_NAME
from shardgen.commands.runlock import OutputInUse, RunLock

HOLD = """
import sys, time
from shardgen.commands.runlock import RunLock
RunLock.acquire(sys.argv[1], "/somewhere/else", "fp-a")
print("locked", flush=True)
time.sleep(600)
"""


def test_a_second_run_on_an_output_dir_in_use_is_refused_naming_the_first_and_gets_it_once_it_is_killed(tmp_path):
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(
            OutputInUse, match=rf"in use by another run \(process {holder.pid} of .* in /somewhere/else"
        ):
            RunLock.acquire(tmp_path, tmp_path, "fp-b")
    finally:
        holder.kill()  # what a killed controller does: no cleanup at all
        holder.wait()
    deadline = time.time() + 10
    while True:
        try:
            lock = RunLock.acquire(tmp_path, tmp_path, "fp-b")
            break
        except OutputInUse:
            if time.time() > deadline:
                raise
            time.sleep(0.1)
    assert '"config_fingerprint": "fp-b"' in (tmp_path / LOCK_NAME).read_text()
    lock.release()


NO_LOCKS = """
import errno, fcntl
def lockf(*args):
    raise OSError(errno.ENOSYS, "Function not implemented")  # Lustre mounted without flock
fcntl.lockf = lockf
"""


def no_record_locks(*args):
    raise OSError(errno.ENOSYS, "Function not implemented")


def test_without_record_locks_a_lock_file_refuses_a_live_run_and_is_taken_over_from_a_killed_one(tmp_path, monkeypatch):
    holder = subprocess.Popen([sys.executable, "-c", NO_LOCKS + HOLD, str(tmp_path)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)  # fmt: skip
    try:
        assert holder.stdout.readline().strip() == "locked", holder.stderr.read()
        assert (tmp_path / HELD_NAME).exists()
        monkeypatch.setattr(fcntl, "lockf", no_record_locks)
        with pytest.raises(OutputInUse, match=rf"in use by another run \(process {holder.pid} of "):
            RunLock.acquire(tmp_path, tmp_path, "fp-b")
        holder.kill()  # a killed controller leaves its lock file behind
        holder.wait()
        lock = RunLock.acquire(tmp_path, tmp_path, "fp-b")  # its process is gone: taken over
        assert '"config_fingerprint": "fp-b"' in (tmp_path / HELD_NAME).read_text()
        lock.release()
        assert not (tmp_path / HELD_NAME).exists()
    finally:
        holder.kill()
        holder.wait()


MOUNTS = """\
/dev/sda1 / ext4 rw,relatime 0 0
home:/export /home nfs4 rw,vers=4.2,hard,proto=tcp 0 0
scratch:/export /scratch nfs rw,vers=3,nolock,hard 0 0
scratch:/export/fast /scratch/fast nfs4 rw,vers=4.1,local_lock=all 0 0
mds@o2ib:/lfs /lustre lustre rw,localflock 0 0
mds@o2ib:/lfs2 /lustre2 lustre rw,flock 0 0
beegfs_nodev /beegfs beegfs rw,cfgFile=/etc/beegfs/beegfs-client.conf 0 0
"""


@pytest.mark.parametrize(
    ("path", "why"),
    [
        ("/home/ada/run/results", None),
        ("/scratch/ada/results", "nfs at /scratch is mounted nolock"),
        ("/scratch/fast/results", "nfs4 at /scratch/fast is mounted with local locks"),
        ("/lustre/ada", "lustre at /lustre is mounted localflock"),
        ("/lustre2/ada", None),
        ("/beegfs/ada", "beegfs at /beegfs keeps record locks on each node unless"),
        ("/tmp/results", None),
    ],
)
def test_the_mount_table_tells_where_record_locks_hold_on_one_node_only(path, why):
    from shardgen.commands.runlock import node_local_locks

    found = node_local_locks(path, MOUNTS)
    assert found == why if why is None else found.startswith(why)


def test_where_locks_are_node_local_the_run_also_holds_the_lock_file(tmp_path, monkeypatch, caplog):
    from shardgen.commands import runlock

    monkeypatch.setattr(runlock, "node_local_locks", lambda path: "nfs at /x is mounted nolock")
    lock = RunLock.acquire(tmp_path, tmp_path, "fp-a")
    assert (tmp_path / HELD_NAME).exists() and "a run on another node would not see this lock" in caplog.text
    with pytest.raises(OutputInUse, match="in use by another run"):  # as a controller on another node
        runlock._HeldFile.acquire(tmp_path / HELD_NAME, {"host": "other"}, tmp_path)
    lock.release()
    assert not (tmp_path / HELD_NAME).exists()


def test_a_run_from_python_lets_go_of_the_output_dir_and_the_queue_when_it_ends(tmp_path):
    """``shardgen.run`` runs the workflow in the caller's process, which goes on: the run's end
    (``release_run``, its onsuccess and onerror) releases the lock, so another process gets the
    directory, and stops the watcher of its pending jobs; twice is harmless (a module's handlers)."""
    from shardgen.cluster import PendingWatcher
    from shardgen.commands.runlock import release_run

    lock = RunLock.acquire(tmp_path, tmp_path, "fp-a")
    watcher = PendingWatcher(str(tmp_path), stop=print, poll_s=3600).start()
    release_run(lock, watcher)
    release_run(lock, watcher)
    watcher._thread.join(5)
    assert not watcher._thread.is_alive(), "the watcher's thread ended"
    other = "import sys; from shardgen.commands.runlock import RunLock; RunLock.acquire(sys.argv[1], '/x', 'fp-b')"
    assert subprocess.run([sys.executable, "-c", other, str(tmp_path)], capture_output=True).returncode == 0
