"""The shardgen command: reads every value from its config file; errors are one clean line."""

from __future__ import annotations

import json

import yaml

from shardgen.cli import main
from tests.conftest import base_config


def test_plan_writes_the_manifest_from_a_config_file(parquet_files, tmp_path):
    config = base_config({"parquet": [str(f) for f in parquet_files]})
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(config))
    assert main(["plan", "--config", str(tmp_path / "c.yaml"), "--manifest", str(tmp_path / "m.json")]) == 0
    assert len(json.loads((tmp_path / "m.json").read_text())["shards"]) == 4


def test_a_bad_config_is_one_line_naming_the_key_and_exit_status_2(tmp_path, capsys):
    (tmp_path / "c.yaml").write_text(
        "input: {parquet: [x.parquet]}\nprompt: {template: hi}\nmodel: {model: m}\nshard: {}\n"
    )
    assert main(["plan", "--config", str(tmp_path / "c.yaml"), "--manifest", str(tmp_path / "m.json")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("shardgen: error: unknown key 'shard' (did you mean 'shards'?)")
    assert "Traceback" not in err
    assert not (tmp_path / "m.json").exists()
