"""What a rerun generates again (issue 50), through the whole workflow on the fake engine: bench/reuse.py,
whose figures bench/results/reuse.md commits (the benchmark itself checks every row's place and result)."""

from __future__ import annotations

import json
import sys

from tests.conftest import ROOT
from tests.integration.workflow import run_bounded


def test_a_rerun_generates_only_the_added_or_edited_rows_and_duplicates_go_to_the_engine_once(tmp_path):
    r = run_bounded([sys.executable, str(ROOT / "bench" / "reuse.py"), "--out", str(tmp_path)])
    assert r.returncode == 0, r.stderr[-3000:]
    result = json.loads((tmp_path / "reuse.json").read_text())
    growth, added = result["growth"], result["added_rows"]
    assert growth["defaults"]["rows_generated"] == added and growth["defaults"]["shards_run_again"] == 1, growth
    assert growth["planned_anew"]["rows_generated"] == added, "the store answers the rows the shards moved"
    assert growth["planned_anew"]["requests_reused"] == result["first_rows"], growth
    assert growth["planned_anew_no_store"]["rows_generated"] == result["first_rows"] + added, growth
    edit, dups = result["edit"], result["duplicates"]
    assert edit["rows_generated"] == edit["rows_changed"], edit
    assert edit["requests_reused"] == edit["rows"] - edit["rows_changed"], edit
    assert dups["rows_generated"] == dups["distinct_requests"], dups
    assert dups["requests_deduplicated"] == 2 * dups["distinct_requests"], dups
