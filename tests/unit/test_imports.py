"""``import shardgen`` and ``shardgen status`` stay light: no feature, no pyarrow, until something reads
a registry (``shardgen.base.registry``), which then has every feature, as a config needs."""

from __future__ import annotations

import json
import subprocess
import sys

from shardgen.data.plan import write_manifest
from tests.conftest import base_config

HEAVY = ("pyarrow", "jinja2", "vllm", "torch", "transformers")


def imported_after(code: str) -> list[str]:
    """The modules a fresh interpreter has imported after ``code``."""
    probe = f"{code}\nimport sys, json\nprint(json.dumps(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout
    return json.loads(out.splitlines()[-1])


def test_import_shardgen_and_the_cli_import_no_feature_and_no_pyarrow():
    for code in ("import shardgen", "from shardgen import cli"):
        modules = imported_after(code)
        assert not [m for m in modules if m.split(".")[0] in HEAVY], code
        assert not {f"shardgen.{f}" for f in ("steps", "functions", "rollouts", "openai_batch")} & set(modules), code


def test_shardgen_status_reads_a_run_without_pyarrow_or_the_features_it_does_not_use(parquet_files, tmp_path):
    config = base_config({"parquet": [str(p) for p in parquet_files]}, output={"dir": str(tmp_path / "results")})
    write_manifest(config, tmp_path / "results" / "plan" / "manifest.json")
    modules = imported_after(
        f"from shardgen.cli import main\nassert main(['status', '--dir', {str(tmp_path / 'results')!r}]) == 0"
    )
    assert not [m for m in modules if m.split(".")[0] in HEAVY]
    features = [m for m in modules if m.removeprefix("shardgen.") in __import__("shardgen").FEATURES]
    assert features == ["shardgen.features.splits"], "the pieces of a split shard, and no other feature"


def test_the_first_read_of_a_registry_imports_every_feature():
    modules = imported_after("from shardgen import config\nassert 'steps' in config.RUN_MODES")
    assert {f"shardgen.{f}" for f in __import__("shardgen").FEATURES} <= set(modules)


def test_the_features_checks_run_in_one_order_whichever_feature_was_imported_first():
    """functions' check before prompts', as shardgen.FEATURES lists them, though prompts is imported first."""
    code = (
        "import json\nfrom shardgen.requests import prompts\nfrom shardgen import config\n"
        "print(json.dumps([h.__module__ for h in config.AFTER_CORE]))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    modules = json.loads(out.splitlines()[-1])
    assert modules.index("shardgen.features.functions") < modules.index("shardgen.requests.prompts"), modules
