"""What a rerun generates again (issue 50), through the whole workflow on the fake engine: bench/reuse.py,
whose figures bench/results/reuse.md commits."""

from __future__ import annotations

import json
import sys

from tests.conftest import ROOT
from tests.integration.workflow import run_bounded


def test_a_file_added_to_the_input_is_all_a_rerun_generates_where_a_plan_made_anew_generates_every_row(tmp_path):
    r = run_bounded([sys.executable, str(ROOT / "bench" / "reuse.py"), "--out", str(tmp_path)])
    assert r.returncode == 0, r.stderr[-3000:]
    result = json.loads((tmp_path / "reuse.json").read_text())
    kept, anew = result["kept"], result["planned_anew"]
    assert kept["rows_generated"] == result["added_rows"] and kept["shards_run_again"] == 1, kept
    assert anew["rows_generated"] == result["first_rows"] + result["added_rows"], anew
