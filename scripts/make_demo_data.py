"""Write the demo dataset: a few Parquet files of short questions.

Usage: python scripts/make_demo_data.py OUT_DIR [ROWS]
"""

from __future__ import annotations

import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

TOPICS = [
    "the moon",
    "volcanoes",
    "honey bees",
    "the Roman Empire",
    "photosynthesis",
    "glaciers",
    "the printing press",
    "octopuses",
    "black holes",
    "coffee",
    "the Silk Road",
    "lightning",
    "penguins",
    "the internet",
    "rainbows",
    "tea",
    "the Great Wall",
    "DNA",
    "earthquakes",
    "owls",
]
STYLES = ["one sentence", "a short haiku", "two short sentences", "a single fun fact"]


def rows(n: int) -> list[dict]:
    return [
        {"id": f"q{i:05d}", "topic": TOPICS[i % len(TOPICS)], "style": STYLES[(i // len(TOPICS)) % len(STYLES)]}
        for i in range(n)
    ]


def main() -> None:
    if len(sys.argv) not in (2, 3):
        sys.exit(__doc__)
    out = Path(sys.argv[1])
    n = int(sys.argv[2]) if len(sys.argv) == 3 else 48
    out.mkdir(parents=True, exist_ok=True)
    data = rows(n)
    half = n // 2
    for i, part in enumerate((data[:half], data[half:])):
        # small row groups, so that shards start inside files and row groups
        pq.write_table(pa.Table.from_pylist(part), out / f"part-{i}.parquet", row_group_size=10)
    print(f"demo data: {n} rows in 2 files under {out}")


if __name__ == "__main__":
    main()
