"""A job of several shards has one stop flag: a signal cannot fall between two shards and be lost.
(The flag inside a shard, with the real engine: tests/integration/test_generate_engine.py.)"""

from __future__ import annotations

import os
import signal

import pytest

from shardgen import generate
from shardgen.engine import Engine
from shardgen.generate import Interrupted


def test_a_signal_during_one_shard_of_a_job_stops_the_next_before_it_starts(tmp_path):
    running = Engine(llm=object())  # a running engine the job was handed: never started or stopped here
    with generate._StopFlag() as stop:
        os.kill(os.getpid(), signal.SIGTERM)  # as Slurm's, arriving while the previous shard commits
        with pytest.raises(Interrupted, match="shard 00001: stopped by SIGTERM"):
            # nothing of the shard is read or written: its plan does not even exist
            generate.run_shard(None, tmp_path / "no-plan.json", "00001", tmp_path / "out", tmp_path / "stats",
                               engine=running, stop=stop)  # fmt: skip
    assert not any(tmp_path.iterdir())
