"""Planning: shard boundaries from metadata, across files and row groups, deterministic."""

from __future__ import annotations

import itertools
import json
import math

import pytest

from shardgen.data.manifest import Manifest
from shardgen.data.plan import build_manifest, shard_id_width, write_manifest
from shardgen.errors import InputError
from tests.conftest import base_config, make_rows, write_parquet


def test_shards_cover_every_row_once_in_order_across_files(parquet_files):
    m = build_manifest(base_config({"parquet": [str(f) for f in parquet_files]}))
    assert m["total_rows"] == 30
    ranges = [(s["start"], s["stop"]) for s in m["shards"]]
    assert ranges == [(0, 8), (8, 16), (16, 24), (24, 30)]
    # shard 1 covers rows 8-9 of file 0 and rows 0-5 of file 1
    assert m["shards"][1]["segments"] == [[0, 8, 10], [1, 0, 6]]
    # the last shard takes the remainder
    assert m["shards"][-1]["segments"] == [[2, 7, 13]]


def test_segment_rows_add_up_to_shard_rows(parquet_files):
    m = build_manifest(base_config({"parquet": [str(f) for f in parquet_files]}, shards={"rows_per_shard": 3}))
    for s in m["shards"]:
        assert sum(stop - start for _, start, stop in s["segments"]) == s["stop"] - s["start"]


def test_same_input_and_config_give_the_same_manifest(parquet_files, tmp_path):
    config = base_config({"parquet": [str(f) for f in parquet_files]})
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    write_manifest(config, a)
    write_manifest(base_config({"parquet": [str(f) for f in parquet_files]}), b)
    assert a.read_text() == b.read_text()


def test_glob_matches_are_taken_in_name_order(tmp_path):
    for name, start in [("b.parquet", 10), ("a.parquet", 0), ("c.parquet", 20)]:
        write_parquet(tmp_path / "d" / name, make_rows(10, start))
    m = build_manifest(base_config({"parquet": [str(tmp_path / "d" / "*.parquet")]}))
    assert [f["path"].rsplit("/", 1)[1] for f in m["source"]["files"]] == ["a.parquet", "b.parquet", "c.parquet"]


def test_explicit_paths_keep_config_order(tmp_path):
    b = write_parquet(tmp_path / "b.parquet", make_rows(4))
    a = write_parquet(tmp_path / "a.parquet", make_rows(4, 4))
    m = build_manifest(base_config({"parquet": [str(b), str(a)]}))
    assert [f["path"] for f in m["source"]["files"]] == [str(b), str(a)]


def test_planning_reads_metadata_and_records_file_identity(parquet_files):
    m = build_manifest(base_config({"parquet": [str(f) for f in parquet_files]}))
    f0 = m["source"]["files"][0]
    assert f0["rows"] == 10 and f0["row_groups"] == [7, 3]
    assert f0["size"] == parquet_files[0].stat().st_size and f0["mtime_ns"] > 0


def test_shard_ids_are_zero_padded_and_sort_as_numbers():
    assert shard_id_width(3) == 5
    assert shard_id_width(100_000) == 5  # ids 00000 .. 99999
    assert shard_id_width(100_001) == 6


def test_manifest_round_trips_and_finds_shards(parquet_files, tmp_path):
    path = tmp_path / "m.json"
    write_manifest(base_config({"parquet": [str(f) for f in parquet_files]}), path)
    m = Manifest.load(path)
    assert m.shard("00002").start == 16
    with pytest.raises(InputError, match="no shard '00009'"):
        m.shard("00009")
    assert json.loads(path.read_text())["version"] == 1


def test_a_missing_file_is_named(tmp_path):
    with pytest.raises(InputError, match="no such file: '.*nope.parquet'"):
        build_manifest(base_config({"parquet": [str(tmp_path / "nope.parquet")]}))


def test_a_glob_matching_nothing_is_named(tmp_path):
    with pytest.raises(InputError, match=r"pattern '.*\*.parquet' matches no file"):
        build_manifest(base_config({"parquet": [str(tmp_path / "*.parquet")]}))


def test_a_file_listed_twice_is_refused(parquet_files):
    with pytest.raises(InputError, match="listed twice"):
        build_manifest(base_config({"parquet": [str(parquet_files[0]), str(parquet_files[0])]}))


def test_files_with_different_columns_are_refused(tmp_path):
    a = write_parquet(tmp_path / "a.parquet", make_rows(3))
    b = write_parquet(tmp_path / "b.parquet", [{"id": "x", "topic": "y"}])
    with pytest.raises(InputError, match=r"b.parquet' has other columns .*missing \['n'\]"):
        build_manifest(base_config({"parquet": [str(a), str(b)]}))


def test_a_template_column_the_input_lacks_is_named(parquet_files):
    config = base_config({"parquet": [str(parquet_files[0])]}, prompt={"template": "{{ title }}"})
    with pytest.raises(InputError, match="uses the column 'title'"):
        build_manifest(config)


def test_an_input_column_that_clashes_with_an_output_column_is_refused(tmp_path):
    f = write_parquet(tmp_path / "a.parquet", [{"topic": "x", "generation": "old"}])
    with pytest.raises(InputError, match=r"a.parquet'\) has the column\(s\) \['generation'\], which this config's out"):
        build_manifest(base_config({"parquet": [str(f)]}))


def test_a_result_column_that_a_later_config_adds_is_refused_for_that_config_without_planning_again(tmp_path):
    """Gold labels in 'label', planned for plain generation; then sampling asks for a choice (which adds
    'label'), or for n > 1 rows per input (which adds 'sample_index'). The plan is not made again: the
    preflight, every job and the merge check the columns for the config they run with."""
    from shardgen.data.plan import check_columns
    from tests.conftest import changed

    f = write_parquet(tmp_path / "a.parquet", [{"topic": "x", "label": "gold", "sample_index": 0}])
    config = base_config({"parquet": [str(f)]})
    build_manifest(config)  # planned for plain generation
    import pyarrow.parquet as pq

    schema = pq.read_schema(f)
    check_columns(config, schema, "a.parquet")
    choice = changed(config, "sampling", structured_outputs={"choice": ["yes", "no"]})
    with pytest.raises(InputError, match=r"a.parquet has the column\(s\) \['label'\]"):
        check_columns(choice, schema, "a.parquet")
    samples = changed(config, "sampling", n=2)
    with pytest.raises(InputError, match=r"\['sample_index'\]"):
        check_columns(samples, schema, "a.parquet")


def test_duplicate_column_names_are_refused_naming_the_column(tmp_path):
    """The template would see one of them and the output would write one value into both."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.Table.from_arrays([pa.array(["a"]), pa.array(["b"]), pa.array(["x"])], names=["text", "text", "topic"])
    pq.write_table(table, tmp_path / "dup.parquet")
    with pytest.raises(InputError, match=r"dup.parquet'\) has more than one column named 'text'"):
        build_manifest(base_config({"parquet": [str(tmp_path / "dup.parquet")]}))


# -- shards.balance: tokens ---------------------------------------------------------------------------


def _skewed(tmp_path, long_len):
    """1,000 short prompts, then 200 long ones, then 800 short: the work sits in a few row groups."""
    rows = [{"id": f"r{i:05d}", "topic": (_text(i, long_len) if 1000 <= i < 1200 else "tea")} for i in range(2000)]
    return write_parquet(tmp_path / "skew.parquet", rows, row_group_size=100)


def _text(seed, length):
    """Distinct text (Parquet would store repeated values once, in a dictionary)."""
    import random

    rng = random.Random(seed)
    return "".join(rng.choice("abcdefgh ") for _ in range(length))


def _true_work(path, shards, output_tokens):
    """Each shard's work from the rows themselves (prompt bytes as tokens + output), not the estimate."""
    import pyarrow.parquet as pq

    lengths = [len(t) for t in pq.read_table(path, columns=["topic"]).column("topic").to_pylist()]
    return [sum(lengths[s["start"] : s["stop"]]) / 4 + output_tokens * (s["stop"] - s["start"]) for s in shards]


def test_token_balanced_shards_are_more_even_than_row_counts_on_skewed_data(tmp_path):
    path = _skewed(tmp_path, long_len=400)
    sampling = {"temperature": 0.0, "max_tokens": 16}
    by_rows = build_manifest(base_config({"parquet": [str(path)]}, shards={"rows_per_shard": 100}, sampling=sampling))
    by_work = build_manifest(
        base_config({"parquet": [str(path)]}, shards={"rows_per_shard": 100, "balance": "tokens"}, sampling=sampling)
    )
    rows_work, balanced_work = _true_work(path, by_rows["shards"], 16), _true_work(path, by_work["shards"], 16)
    # the same number of shards, each row exactly once, in order
    assert len(by_work["shards"]) == len(by_rows["shards"]) == 20
    assert by_work["shards"][0]["start"] == 0 and by_work["shards"][-1]["stop"] == 2000
    assert all(a["stop"] == b["start"] for a, b in zip(by_work["shards"], by_work["shards"][1:], strict=False))
    # the largest shard's work against the mean
    spread = [max(w) / (sum(w) / len(w)) for w in (rows_work, balanced_work)]
    assert spread[0] > 4 and spread[1] < 1.2, spread
    assert by_work["balance"] == "tokens"
    assert sum(s["estimated_tokens"] for s in by_work["shards"]) == pytest.approx(sum(balanced_work), rel=0.05)


def test_token_balanced_shards_never_exceed_four_times_rows_per_shard(tmp_path):
    """The long rows take almost all the work: the short stretches would make shards of ~1,000 rows,
    and are cut at 4 x 100 instead (which adds shards)."""
    path = _skewed(tmp_path, long_len=100_000)
    config = base_config({"parquet": [str(path)]}, shards={"rows_per_shard": 100, "balance": "tokens"})
    shards = build_manifest(config)["shards"]
    assert max(s["stop"] - s["start"] for s in shards) == 400
    assert len(shards) > 20
    assert sum(s["stop"] - s["start"] for s in shards) == 2000


def test_token_balanced_planning_is_deterministic_and_reads_metadata_only(tmp_path, monkeypatch):
    import pyarrow.parquet as pq

    path = _skewed(tmp_path, long_len=400)
    config = base_config({"parquet": [str(path)]}, shards={"rows_per_shard": 100, "balance": "tokens"})
    first = build_manifest(config)
    monkeypatch.setattr(pq.ParquetFile, "iter_batches", lambda *a, **k: pytest.fail("read rows"))
    monkeypatch.setattr(pq.ParquetFile, "read_row_group", lambda *a, **k: pytest.fail("read rows"))
    assert build_manifest(config) == first


def test_token_balance_on_a_hugging_face_dataset_follows_the_arrow_sizes(tmp_path):
    import datasets

    rows = [{"id": f"r{i:05d}", "topic": (_text(i, 400) if i < 1024 else "tea")} for i in range(4096)]
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "ds"))
    config = base_config({"disk": str(tmp_path / "ds")}, shards={"rows_per_shard": 512, "balance": "tokens"})
    shards = build_manifest(config)["shards"]
    # the first 1,024 rows hold most of the work: most shards fall within them
    assert len(shards) == 8 and shards[3]["stop"] <= 1024
    assert shards[-1]["stop"] == 4096


# -- the order workers take shards in, and shards.tail: guided ------------------------------------------


def _manifest(sizes, estimates=None):
    shards, start = [], 0
    for i, n in enumerate(sizes):
        shards.append({"id": f"{i:05d}", "start": start, "stop": start + n, "segments": []})
        if estimates is not None:
            shards[-1]["estimated_tokens"] = estimates[i]
        start += n
    return Manifest({"version": 1, "total_rows": start, "shards": shards})


def test_workers_take_the_largest_estimated_work_first_and_ties_in_plan_order():
    from shardgen.data.manifest import work_order

    # the estimate decides, not the rows
    assert work_order(_manifest([5, 5, 5, 5], [10, 40, 10, 40])) == ["00001", "00003", "00000", "00002"]
    # no estimate: rows; equal shards keep plan order, the smaller remainder comes last
    assert work_order(_manifest([3, 8, 8, 2, 8])) == ["00001", "00002", "00004", "00000", "00003"]
    # an estimate on some shards only is not used
    m = _manifest([3, 8], [100, 1])
    del m.data["shards"][1]["estimated_tokens"]
    assert work_order(m) == ["00001", "00000"]


def test_the_guided_tail_cuts_the_end_of_the_plan_smaller_down_to_the_floor():
    from shardgen.data.plan import TAIL_FLOOR, TAIL_FRACTION, RowCurve, guided_tail

    total, per, workers = 100_000, 1000, 4
    base = [*range(0, total, per), total]
    cuts = guided_tail(base, RowCurve(total), workers)
    assert cuts == guided_tail(list(base), RowCurve(total), workers)  # deterministic
    # every row exactly once, in order
    assert cuts[0] == 0 and cuts[-1] == total and all(a < b for a, b in itertools.pairwise(cuts))
    sizes = [b - a for a, b in itertools.pairwise(cuts)]
    # the plan's shards stay while one is at most an eighth of the rows left per worker: up to the one
    # that starts 32,000 rows before the end
    kept = [c for c in base if c <= total - per * workers / TAIL_FRACTION + per]
    assert kept[-1] == 69_000 and cuts[: len(kept)] == kept and cuts[len(kept)] < kept[-1] + per
    tail = sizes[len(kept) - 1 :]
    # then each shard is an eighth of the rows left per worker, shrinking, down to the floor
    assert tail[0] == math.ceil(31_000 / (workers * 8)) == 969 and tail[1] == math.ceil((31_000 - 969) / 32)
    assert all(a >= b for a, b in itertools.pairwise(tail[:-1]))
    floor = TAIL_FLOOR * per
    assert min(tail[:-1]) == floor and tail.count(floor) > 10 and floor / 2 <= tail[-1] <= 1.5 * floor
    assert len(cuts) - len(base) > 30  # more, smaller shards at the end


def test_the_guided_tail_follows_the_estimated_work():
    from shardgen.data.plan import BYTES_PER_TOKEN, TAIL_FLOOR, WorkCurve, guided_tail, shard_works

    # rows 6,000 to 7,999 take nine times the work of the rows before them: 24,000 in all
    curve = WorkCurve([(6000, 0), (2000, 8 * BYTES_PER_TOKEN * 2000)], 1, 8000)
    base = [*range(0, 8000, 500), 8000]
    cuts = guided_tail(base, curve, 2)
    works = shard_works(curve, cuts)
    assert cuts[-1] == 8000 and all(a < b for a, b in itertools.pairwise(cuts))
    # the light shards stay; the first heavy one (4,500) is more than an eighth of the 18,000 left per
    # worker: from there each shard is 18,000 / 16, then less, by work, not rows
    assert cuts[:13] == base[:13] and works[12] == pytest.approx(1125, abs=9)
    tail = works[12:]
    assert all(a >= b for a, b in itertools.pairwise(tail))
    floor = TAIL_FLOOR * 24000 / 16
    assert min(tail[:-1]) == pytest.approx(floor, abs=9) and floor / 2 <= tail[-1] <= 1.5 * floor


def test_a_guided_tail_shard_has_no_more_rows_than_the_plans_largest():
    from shardgen.data.plan import BYTES_PER_TOKEN, WorkCurve, guided_tail

    # one heavy stretch starts the tail; the light rows after it would make tail shards of many rows
    curve = WorkCurve([(1000, 0), (500, 99 * BYTES_PER_TOKEN * 500), (6500, 0)], 1, 8000)
    base = [*range(0, 8000, 500), 8000]
    cuts = guided_tail(base, curve, 1)
    assert cuts[:3] == [0, 500, 1000] and len(cuts) > len(base)
    assert max(b - a for a, b in itertools.pairwise(cuts)) == 500 and cuts[-1] == 8000


def test_a_guided_tail_plans_more_shards_at_the_end_and_says_so_in_the_manifest(parquet_files):
    inputs = {"parquet": [str(f) for f in parquet_files]}
    plain = build_manifest(base_config(inputs, shards={"rows_per_shard": 2}))
    guided = build_manifest(base_config(inputs, shards={"rows_per_shard": 2, "workers": 2, "tail": "guided"}))
    assert "tail" not in plain and guided["tail"] == {"kind": "guided", "workers": 2}
    rows = [(s["start"], s["stop"]) for s in guided["shards"]]
    assert rows[0] == (0, 2) and rows[-1][1] == 30 and len(rows) > len(plain["shards"])
    assert sum(b - a for a, b in rows) == 30 and all(r[1] == n[0] for r, n in itertools.pairwise(rows))
    assert [s["id"] for s in guided["shards"]] == [f"{i:05d}" for i in range(len(rows))]
    Manifest(guided)  # readable as any plan


def test_without_a_tail_the_manifest_is_as_before(parquet_files):
    """Plans of configs without shards.tail keep their shards, keys and order (their runs' fingerprints)."""
    m = build_manifest(base_config({"parquet": [str(f) for f in parquet_files]}, shards={"rows_per_shard": 8}))
    assert list(m) == ["version", "source", "total_rows", "rows_per_shard", "balance", "shards"]
    assert [(s["start"], s["stop"]) for s in m["shards"]] == [(0, 8), (8, 16), (16, 24), (24, 30)]
    assert all(list(s) == ["id", "start", "stop", "segments"] for s in m["shards"])


def test_a_guided_tail_needs_workers(parquet_files):
    from shardgen.errors import ConfigError

    with pytest.raises(ConfigError, match="needs shards.workers"):
        base_config({"parquet": [str(f) for f in parquet_files]}, shards={"tail": "guided"})


def test_workers_get_the_guided_tail_by_default_and_none_turns_it_off(parquet_files):
    """The defaults deliver (issue 38): with shards.workers and no shards.tail the plan cuts its tail, as
    with tail: guided; tail: none keeps the shards of `balance`, as a run without workers has."""
    inputs = {"parquet": [str(f) for f in parquet_files]}
    by_default = build_manifest(base_config(inputs, shards={"rows_per_shard": 2, "workers": 2}))
    guided = build_manifest(base_config(inputs, shards={"rows_per_shard": 2, "workers": 2, "tail": "guided"}))
    off = build_manifest(base_config(inputs, shards={"rows_per_shard": 2, "workers": 2, "tail": "none"}))
    plain = build_manifest(base_config(inputs, shards={"rows_per_shard": 2}))
    assert by_default["tail"] == {"kind": "guided", "workers": 2} and by_default["shards"] == guided["shards"]
    assert "tail" not in off and off["shards"] == plain["shards"]


# -- a plan made again keeps the shards of the plan before it -------------------------------------------


def _grown(tmp_path, config_for, added: str, **shards):
    """A plan over two files, then the same with a third file ``added`` (a name that sorts after or
    before them) in the same directory; both plans written as the workflow writes them."""
    data = tmp_path / "d"
    write_parquet(data / "b.parquet", make_rows(10, 0))
    write_parquet(data / "c.parquet", make_rows(7, 10))
    manifest = tmp_path / "plan" / "manifest.json"
    before = write_manifest(config_for(data, **shards), manifest)
    manifest.unlink()  # Snakemake removes a job's outputs before it runs again
    write_parquet(data / added, make_rows(13, 100))
    return before, write_manifest(config_for(data, **shards), manifest)


def _parquet_dir(data, **shards):
    return base_config({"parquet": [str(data / "*.parquet")]}, shards={"rows_per_shard": 4, **shards})


@pytest.mark.parametrize("shards", [{}, {"balance": "tokens"}, {"tail": "guided", "workers": 2}], ids=str)
def test_a_file_added_after_the_others_keeps_every_shard_planned_and_gets_shards_of_its_own(tmp_path, shards):
    before, after = _grown(tmp_path, _parquet_dir, "d.parquet", **shards)
    kept = len(before["shards"])
    assert after["shards"][:kept] == before["shards"], "every shard as it was: the same rows, ids, fingerprints"
    new = after["shards"][kept:]
    assert new and all(seg[0] == 2 for s in new for seg in s["segments"]), "the new shards hold the new file alone"
    assert new[0]["start"] == before["total_rows"] and new[-1]["stop"] == after["total_rows"] == 30
    assert [s["id"] for s in after["shards"]] == [f"{i:05d}" for i in range(len(after["shards"]))]
    assert all(a["stop"] == b["start"] for a, b in itertools.pairwise(after["shards"])), "every row once, in order"
    # a plan from nothing over the grown input is the one a first run would make; this one differs only after
    # the kept shards
    from shardgen.data import plan as planning

    fresh = planning.build_manifest(_parquet_dir(tmp_path / "d", **shards))
    assert {k: v for k, v in fresh.items() if k != "shards"} == {k: v for k, v in after.items() if k != "shards"}


def test_a_file_added_before_the_others_or_an_edited_one_plans_again_from_there(tmp_path):
    before, after = _grown(tmp_path, _parquet_dir, "a.parquet")  # sorts first: nothing kept
    assert after == build_manifest(_parquet_dir(tmp_path / "d")), "planned as a first run would"
    assert [f["path"][-9:] for f in after["source"]["files"]] == [
        "a.parquet",
        *(f["path"][-9:] for f in before["source"]["files"]),
    ]
    manifest = tmp_path / "plan" / "manifest.json"
    write_parquet(tmp_path / "d" / "c.parquet", make_rows(9, 10))  # the last file edited
    edited = write_manifest(_parquet_dir(tmp_path / "d"), manifest)
    kept = [s for s in after["shards"] if all(seg[0] < 2 for seg in s["segments"])]
    assert edited["shards"][: len(kept)] == kept and edited["shards"][len(kept)]["start"] == kept[-1]["stop"]
    assert edited["total_rows"] == 13 + 10 + 9
    other = write_manifest(_parquet_dir(tmp_path / "d", rows_per_shard=5), manifest)  # other settings
    assert other == build_manifest(_parquet_dir(tmp_path / "d", rows_per_shard=5)), "nothing kept"
