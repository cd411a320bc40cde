"""Images for a vision-language model on the real engine, through the workflow: two image columns
per row (PNG bytes, and a ``datasets`` Image struct holding a file path), placed in the user message
where the model's chat template puts them; an image that does not decode is a per-row error."""

from __future__ import annotations

import io
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image

from tests.conftest import ROOT
from tests.integration.workflow import run_workflow, workflow_config

pytestmark = pytest.mark.engine

VLM = ROOT / "models" / "vlm"
IMAGE_TOKENS = 7  # one image of the test VLM: <fake_token_around_image><global-img><image>*4<fake_token_around_image>


def png(color: tuple[int, int, int], size=(80, 60)) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", size, color).save(buf, format="PNG")
    return buf.getvalue()


def test_a_vision_language_model_gets_each_row_s_images_and_a_broken_one_is_a_row_error(tmp_path):
    scans = tmp_path / "scans"
    scans.mkdir()
    rows = []
    for i in range(8):
        (scans / f"{i}.png").write_bytes(png((30 * i, 100, 200 - 20 * i), (64 + 8 * i, 48)))
        rows.append({"id": f"r{i:05d}", "topic": "a chart", "photo": png((255 - 30 * i, 20 * i, 60)),
                     "scan": {"bytes": None, "path": str(scans / f"{i}.png")}})  # fmt: skip
    rows[3]["photo"] = b"not an image"
    path = tmp_path / "data" / "in.parquet"
    path.parent.mkdir()
    pq.write_table(pa.Table.from_pylist(rows), path)
    config = workflow_config(
        {"parquet": [str(path)], "id_column": "id"},
        prompt={"template": "Describe {{ topic }}.", "images": ["photo", "scan"]},
        errors={"max_rate": 0.5},
    )
    config["model"].update(model=str(VLM), max_model_len=512)
    run_workflow(tmp_path, config, "local")

    table = pq.read_table(tmp_path / "results" / "output.parquet").to_pylist()
    assert [r["id"] for r in table] == [r["id"] for r in rows], "every row exactly once, in order"
    bad = table[3]
    assert bad["error"].startswith("bad_image") and "column 'photo'" in bad["error"] and bad["generation"] is None
    good = [r for i, r in enumerate(table) if i != 3]
    assert all(r["error"] is None and r["generated_tokens"] > 0 for r in good)
    # the same text in every row: the prompt holds the two images' tokens (the engine's own count)
    assert len({r["prompt_tokens"] for r in good}) == 1 and good[0]["prompt_tokens"] > 2 * IMAGE_TOKENS
    stats = json.loads((tmp_path / "results" / "stats.json").read_text())
    assert stats["error_reasons"] == {"bad_image": 1}
    shard = json.loads((tmp_path / "results" / "shards" / "00000.stats.json").read_text())
    assert shard["engine"]["args"]["limit_mm_per_prompt"] == {"image": 2}
