"""One run per output directory: a second run is refused, naming the first; a killed run leaves no lock."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from shardgen.runlock import LOCK_NAME, OutputInUse, RunLock

HOLD = """
import sys, time
from shardgen.runlock import RunLock
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
