"""What the prefix order's window costs the prefix cache, without an engine: the order the real feed
(``feed.requests.prepared_requests``) submits a shard's rows in, through a prefix cache of a fixed size.

Rows are questions about documents, shuffled over the shard (the ``order`` comparison of
``bench/throughput.py``, larger): a row's prefix is its document. The cache holds the prefixes of
the last ``--cache`` documents used (least recently used goes first); a row hits when its
document is there. Orders of the same shard: ``input``; ``prefix`` with the window of a run
without elastic workers (``feed.requests.order_window``, 2,048 rows at 512 in flight: the same as before
issue 38); ``prefix`` on an elastic worker's piece, which a split may cut, at a few rates (rows
finished per second: the window is what it finishes in ``feed.requests.ORDER_WINDOW_SECONDS``). The hit rate is
of rows; the engine's is of prompt tokens, which for long shared documents is close to it.

Usage: python bench/order.py [--cache N] [--out DIR]
"""

from __future__ import annotations

import argparse
import random
import sys
from collections import OrderedDict
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from common import write_results  # noqa: E402

from shardgen.jobs import feed  # noqa: E402
from shardgen.jobs.feed.requests import prepared_requests  # noqa: E402
from shardgen.jobs.feed.shard_loop import RowStream  # noqa: E402

IN_FLIGHT = 512  # the feed's window at max_num_seqs 256 (2 x)
RATES = (35, 10, 2)  # rows/s of a piece a split may cut
# (rows of the shard, questions per document)
CASES = [(2_500, 4), (2_500, 16), (10_000, 4), (10_000, 16), (40_000, 16)]


def submitted(rows: int, questions: int, window: str) -> list[int]:
    """The documents of the shard's rows in the order the feed submits them."""
    docs = [d for d in range(rows // questions) for _ in range(questions)]
    random.Random(rows * 31 + questions).shuffle(docs)
    stream = RowStream(enumerate({"doc": d} for d in docs), len(docs), 0)
    # a prompt's tokens: its document (4 tokens of it), then its question
    renderer = SimpleNamespace(render_batch=lambda batch: [r["doc"] for r in batch])
    tokenizer = SimpleNamespace(encode_batch=lambda ds: [[d, d, d, d, 7] for d in ds])
    task = SimpleNamespace(params=lambda index, row: None)
    sizes = {"input": None, "prefix": lambda: feed.requests.order_window(IN_FLIGHT)}
    sizes |= {f"prefix, {r} rows/s": (lambda r=r: feed.requests.order_window(IN_FLIGHT, r)) for r in RATES}
    requests = prepared_requests(stream, renderer, tokenizer, task, None, order_window=sizes[window])
    return [r.prompt_token_ids[0] for r in requests]


def hit_rate(order: list[int], cache: int) -> float:
    lru: OrderedDict[int, None] = OrderedDict()
    hits = 0
    for doc in order:
        if doc in lru:
            hits += 1
            lru.move_to_end(doc)
        else:
            lru[doc] = None
            if len(lru) > cache:
                lru.popitem(last=False)
    return hits / len(order)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cache", type=int, default=64, help="documents the prefix cache holds")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    args = ap.parse_args()
    orders = ["input", "prefix", *(f"prefix, {r} rows/s" for r in RATES)]
    cases = []
    for rows, questions in CASES:
        case = {"rows": rows, "questions": questions, "most": round(1 - 1 / questions, 4)}
        for order in orders:
            case[order] = round(hit_rate(submitted(rows, questions, order), args.cache), 4)
        cases.append(case)
    windows = ", ".join(f"{feed.requests.order_window(IN_FLIGHT, r):,} at {r} rows/s" for r in RATES)
    md = (
        f"Prefix-cache hits by submission order (`python bench/order.py`, no engine): the real feed's order "
        f"(`feed.requests.prepared_requests`, {IN_FLIGHT} in flight) through a cache of the last {args.cache} "
        "documents; "
        "questions about documents, shuffled over the shard. `prefix`: a run without elastic workers "
        f"(a window of {feed.requests.order_window(IN_FLIGHT):,}, as before issue 38); `rows/s`: an elastic worker's "
        "piece "
        f"at that rate, which sorts what it finishes in {feed.requests.ORDER_WINDOW_SECONDS:g} s ({windows}). `most`: "
        "every question after a document's first.\n\n"
        f"| shard rows | questions per document | {' | '.join(orders)} | most |\n"
        f"|---|---|{'---|' * len(orders)}---|\n"
    )
    for c in cases:
        hits = " | ".join(f"{c[o]:.1%}" for o in orders)
        md += f"| {c['rows']:,} | {c['questions']} | {hits} | {c['most']:.1%} |\n"
    write_results(args.out, "order", {"cache_documents": args.cache, "in_flight": IN_FLIGHT, "cases": cases}, md)


if __name__ == "__main__":
    main()
