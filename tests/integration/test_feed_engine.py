"""Throughput mechanics: the queue is kept full (the feed's, on the fake engine), and the prefix-aware
order hits the real engine's prefix cache more often than a shuffled one."""

from __future__ import annotations

import random

import pyarrow.parquet as pq
import pytest

from shardgen.data.plan import write_manifest
from shardgen.engines.fake import FakeEngine
from shardgen.jobs.generate import JobContext, run_shard
from tests.conftest import base_config, make_rows, write_parquet


def test_the_engine_queue_never_drains_while_rows_remain(tmp_path, monkeypatch):
    """Seen from the engine: before every step while rows remain, it holds a full window of requests. The
    fake engine (answering 2 requests a step): the window is the feed's, whatever the engine."""
    window, rows = 6, 40
    data = write_parquet(tmp_path / "in.parquet", make_rows(rows))
    config = base_config({"parquet": [str(data)]}, shards={"rows_per_shard": rows}, model={"max_num_seqs": 2},
                         output={"dir": str(tmp_path / "out")}, engine={"kind": "fake"})  # fmt: skip
    write_manifest(config, tmp_path / "m.json")
    engine = FakeEngine()
    events: list[tuple[str, int]] = []
    real_step, real_submit = engine.step, engine.submit

    def step():
        events.append(("step", len(engine._queue)))
        return real_step()

    def submit(requests):
        out = real_submit(requests)
        events.extend(("add", len(engine._queue)) for _ in requests)
        return out

    with monkeypatch.context() as m:
        m.setattr(engine, "step", step)
        m.setattr(engine, "submit", submit)
        stats = run_shard(config, tmp_path / "m.json", "00000", tmp_path / "o.parquet", tmp_path / "o.json",
                          JobContext(engine, window=window))  # fmt: skip
    last_add = max(i for i, (kind, _) in enumerate(events) if kind == "add")
    before_last_add = [n for kind, n in events[:last_add] if kind == "step"]
    assert sum(1 for kind, _ in events if kind == "add") == rows
    assert len(before_last_add) > 5, "rows were added over many steps, not all at once"
    assert set(before_last_add) == {window}, "every step while rows remained started with a full window"
    assert stats["feed"]["steps_short"] == 0 and stats["feed"]["window"] == window
    assert pq.read_table(tmp_path / "o.parquet").column("row_index").to_pylist() == list(range(rows))


# Documents long enough to fill two 128-token cache blocks each, with several
# questions each: the prefix shared by the questions of one document.
WORDS = "river mountain lantern orchard harbor meadow violin compass glacier pepper canyon ember".split()


def documents(n: int) -> list[str]:
    rng = random.Random(5)
    return [f"Document {d}: " + " ".join(rng.choice(WORDS) for _ in range(300)) for d in range(n)]


def run_order(tmp_path, engine, rows: list[dict], order: str) -> tuple[list, dict]:
    work = tmp_path / order
    data = write_parquet(work / "in.parquet", rows)
    config = base_config(
        {"parquet": [str(data)]},
        prompt={"template": "{{ doc }}\n\nQuestion {{ q }}: what is the first word?", "chat": False, "order": order},
        sampling={"temperature": 0.0, "max_tokens": 1},
        shards={"rows_per_shard": len(rows)},
        output={"dir": str(work / "out")},
    )
    write_manifest(config, work / "m.json")
    engine.llm.reset_prefix_cache()  # each order starts from a cold cache
    stats = run_shard(config, work / "m.json", "00000", work / "o.parquet", work / "o.json", JobContext(engine))
    return pq.read_table(work / "o.parquet").to_pylist(), stats


@pytest.mark.engine
def test_prefix_aware_order_hits_the_prefix_cache_more_than_a_shuffled_order(tmp_path, engine):
    # 16 documents (about 330 tokens) x 4 questions, shuffled. Their shared prefixes (2 blocks
    # of 128 tokens each, 32 in all) do not fit the test engine's KV cache
    # (22 blocks), so a shuffled order evicts a document before its next
    # question comes; sorted, its questions run together.
    docs = documents(16)
    rows = [{"doc": d, "q": q, "key": f"{i}-{q}"} for i, d in enumerate(docs) for q in range(4)]
    random.Random(9).shuffle(rows)
    shuffled, s_stats = run_order(tmp_path, engine, rows, "input")
    ordered, o_stats = run_order(tmp_path, engine, rows, "prefix")
    assert [r["key"] for r in ordered] == [r["key"] for r in rows], "the output is in input order"
    assert [r["generation"] for r in ordered] == [r["generation"] for r in shuffled], "the order changes no text"
    hit_sorted, hit_shuffled = o_stats["prefix_cache_hit_rate"], s_stats["prefix_cache_hit_rate"]
    # each document's later questions can reuse its 256 shared tokens: at most 3 of 4 requests
    assert hit_sorted > hit_shuffled + 0.15, (hit_sorted, hit_shuffled)
    assert hit_sorted > 0.5
