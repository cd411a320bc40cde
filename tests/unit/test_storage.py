"""Object storage against a real S3-compatible server (moto's server mode, a separate process: the
``s3_server`` fixture): ``s3://`` input planned from footers and read by row group as the same files on
local disk are, an object rewritten after planning refused naming it, the errors that name the object
or key, and ``output.upload`` verified and skipped when nothing changed. (Through the Slurm profile:
tests/integration/test_workflow.py, the Slurm profile test.)"""

from __future__ import annotations

import io
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from shardgen import trust
from shardgen.base import storage
from shardgen.base.storage import StorageError
from shardgen.config import RunConfig
from shardgen.data.manifest import Manifest, Segment
from shardgen.data.plan import build_manifest
from shardgen.errors import ConfigError, InputError
from shardgen.jobs.merge import upload
from tests.conftest import make_rows, s3_bucket, write_parquet

pytestmark = pytest.mark.usefixtures("s3_server")


def parquet_bytes(rows: list[dict]) -> bytes:
    buf = io.BytesIO()
    pq.write_table(pa.Table.from_pylist(rows), buf, row_group_size=7)
    return buf.getvalue()


def config(tmp_path, parquet: list[str], endpoint: str, **output) -> RunConfig:
    return RunConfig.from_dict({
        "input": {"parquet": parquet, "storage_options": {"endpoint_url": endpoint}},
        "shards": {"rows_per_shard": 10}, "prompt": {"template": "{{ topic }}"}, "model": {"model": "m"},
        "output": {"dir": str(tmp_path / "results"), **output},
    })  # fmt: skip


def test_s3_objects_plan_and_read_as_the_same_files_on_local_disk_do(tmp_path, s3_server):
    client = s3_bucket(s3_server, "plan-read")
    local = []
    for i, n in enumerate((13, 9, 21)):
        rows = make_rows(n, start=100 * i)
        local.append(str(write_parquet(tmp_path / "local" / f"part-{i}.parquet", rows)))
        client.put_object(Bucket="plan-read", Key=f"data/part-{i}.parquet", Body=parquet_bytes(rows))
    client.put_object(Bucket="plan-read", Key="data/sub/other.parquet", Body=parquet_bytes(make_rows(2)))
    remote = config(tmp_path, ["s3://plan-read/data/*.parquet"], s3_server)  # one level: not data/sub/
    on_disk = config(tmp_path, local, s3_server)
    plan, plan_local = build_manifest(remote), build_manifest(on_disk)
    assert [(s["start"], s["stop"], s["segments"]) for s in plan["shards"]] == [
        (s["start"], s["stop"], s["segments"]) for s in plan_local["shards"]]  # fmt: skip
    files = plan["source"]["files"]
    assert [f["path"] for f in files] == [f"s3://plan-read/data/part-{i}.parquet" for i in range(3)]
    assert all(f["etag"] and f["size"] > 0 for f in files)
    (tmp_path / "results" / "plan").mkdir(parents=True)
    (tmp_path / "results" / "plan" / "manifest.json").write_text(json.dumps(plan))
    source = Manifest.load(tmp_path / "results" / "plan" / "manifest.json").source()
    got = [r for s in Manifest.load(tmp_path / "results" / "plan" / "manifest.json").shards
           for b in source.read(s.segments) for r in b.to_pylist()]  # fmt: skip
    assert got == [r for p in local for r in pq.read_table(p).to_pylist()]
    # as glob.glob: '**' alone in a component crosses directories (zero or more), within a name it is '*'
    assert build_manifest(config(tmp_path, ["s3://plan-read/data/**/*.parquet"], s3_server))["total_rows"] == 45
    assert build_manifest(config(tmp_path, ["s3://plan-read/data/**.parquet"], s3_server))["total_rows"] == 43

    # rewritten between planning and a job: refused, naming the object
    client.put_object(Bucket="plan-read", Key="data/part-1.parquet", Body=parquet_bytes(make_rows(9, start=7)))
    with pytest.raises(InputError, match=r"the object 's3://plan-read/data/part-1.parquet' changed after planning"):
        list(source.read(Manifest.load(tmp_path / "results" / "plan" / "manifest.json").shards[1].segments))


def test_a_missing_object_a_glob_of_none_and_a_wrong_endpoint_are_named(tmp_path, s3_server, monkeypatch):
    monkeypatch.setattr(storage, "MAX_ATTEMPTS", 2)  # (6 take 8 to 25 s against a closed port)
    s3_bucket(s3_server, "named")
    with pytest.raises(InputError, match=r"input.parquet: no such object: 's3://named/nope.parquet'"):
        build_manifest(config(tmp_path, ["s3://named/nope.parquet"], s3_server))
    with pytest.raises(InputError, match=r"the pattern 's3://named/x/\*.parquet' matches no object"):
        build_manifest(config(tmp_path, ["s3://named/x/*.parquet"], s3_server))
    with pytest.raises(InputError, match=r"cannot list 's3://named/a.parquet'.*the endpoint http://127.0.0.1:9"):
        build_manifest(config(tmp_path, ["s3://named/a.parquet"], "http://127.0.0.1:9"))


def test_missing_credentials_are_named_when_the_run_plans(tmp_path, s3_server, monkeypatch):
    """No credentials where AWS tools look (the environment, the shared files, an instance role): the
    client sends its requests unsigned, which the store answers with 403, as S3 does for a private
    bucket (the proxy). Planning, on the login node before any job, names the objects and where
    credentials are read from."""
    from tests.s3faults import FaultProxy

    client = s3_bucket(s3_server, "private")
    client.put_object(Bucket="private", Key="data/part-0.parquet", Body=parquet_bytes(make_rows(3)))
    for key in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    with FaultProxy(s3_server, signed_only=True) as proxy:
        with pytest.raises(InputError) as e:
            build_manifest(config(tmp_path, ["s3://private/data/*.parquet"], proxy.url))
        assert proxy.denied, proxy.seen
    said = str(e.value)
    assert "'s3://private/data/*.parquet'" in said, said
    assert "AWS_ACCESS_KEY_ID" in said and "~/.aws/credentials" in said, said


def test_credentials_in_storage_options_are_refused_naming_the_key(tmp_path, s3_server):
    raw = {"input": {"parquet": ["s3://b/x.parquet"], "storage_options": {"endpoint_url": s3_server}},
           "prompt": {"template": "{{ topic }}"}, "model": {"model": "m"}}  # fmt: skip
    raw["input"]["storage_options"]["aws_secret_access_key"] = "abc"
    with pytest.raises(ConfigError, match=r"input.storage_options.aws_secret_access_key"):
        trust.check_credentials(raw)  # (what the Snakefile runs first, before any message could quote it)


def test_the_upload_verifies_each_object_and_a_rerun_that_changed_nothing_uploads_nothing(tmp_path, s3_server):
    client = s3_bucket(s3_server, "uploads")
    run = config(tmp_path, ["x.parquet"], s3_server, upload="s3://uploads/runs/a/")
    out = tmp_path / "results"
    (out / "plan").mkdir(parents=True)
    dataset = out / "output.parquet"
    pq.write_table(pa.Table.from_pylist(make_rows(50)), dataset)
    stats = out / "stats.json"
    stats.write_text(json.dumps({"rows": 50}))
    first = upload(run, dataset, stats, out / "uploaded.json")
    assert first["uploaded"] == ["s3://uploads/runs/a/output.parquet", "s3://uploads/runs/a/stats.json"]
    body = client.get_object(Bucket="uploads", Key="runs/a/output.parquet")["Body"].read()
    assert body == dataset.read_bytes()
    again = upload(run, dataset, stats, out / "uploaded.json")
    assert again["uploaded"] == [] and len(again["skipped"]) == 2
    stats.write_text(json.dumps({"rows": 50, "more": 1}))
    assert upload(run, dataset, stats, out / "uploaded.json")["uploaded"] == ["s3://uploads/runs/a/stats.json"]
    client.delete_object(Bucket="uploads", Key="runs/a/output.parquet")  # gone there: uploaded again
    assert upload(run, dataset, stats, out / "uploaded.json")["uploaded"] == ["s3://uploads/runs/a/output.parquet"]

    nowhere = config(tmp_path, ["x.parquet"], s3_server, upload="s3://no-such-bucket/runs/")
    assert "cannot write under 's3://no-such-bucket/runs/'" in storage.check_writable(
        nowhere.output.upload, nowhere.input.storage_options)  # fmt: skip
    with pytest.raises(StorageError, match=r"cannot write 's3://no-such-bucket/runs/output.parquet'"):
        upload(nowhere, dataset, stats, out / "uploaded.json")
    assert storage.check_writable(run.output.upload, run.input.storage_options) is None


def test_an_upload_cut_off_leaves_no_part_of_the_file_under_its_name_and_the_rerun_uploads_it(
    tmp_path, s3_server, monkeypatch
):
    client = s3_bucket(s3_server, "cut-off")
    run = config(tmp_path, ["x.parquet"], s3_server, upload="s3://cut-off/run")
    (tmp_path / "results" / "plan").mkdir(parents=True)
    big = tmp_path / "results" / "output.parquet"
    big.write_bytes(bytes(range(256)) * (24 << 12))  # 24 MiB: parts of it go up before the cut
    stats = tmp_path / "results" / "stats.json"
    stats.write_text("{}")
    real_open = open

    class Cut:
        """The local file, read until a Ctrl-C arrives after its first 16 MiB."""

        def __init__(self, *args):
            self.f, self.reads = real_open(*args), 0

        def read(self, n):
            self.reads += 1
            if self.reads == 3:
                raise KeyboardInterrupt
            return self.f.read(n)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

    opened = []

    def cut(path, mode="r"):  # the second open of the file: the upload's, after its checksum's
        opened.append(path)
        return Cut(path, mode) if opened.count(big) == 2 else real_open(path, mode)

    monkeypatch.setattr(storage, "open", cut, raising=False)
    with pytest.raises(KeyboardInterrupt):
        upload(run, big, stats, tmp_path / "results" / "uploaded.json")
    assert opened.count(big) == 2, "cut off while uploading"
    keys = [o["Key"] for o in client.list_objects_v2(Bucket="cut-off").get("Contents", [])]
    assert "run/output.parquet" not in keys, "no part of it under its name"  # (pyarrow may leave "run/")
    monkeypatch.undo()
    assert upload(run, big, stats, tmp_path / "results" / "uploaded.json")["uploaded"] == [
        "s3://cut-off/run/output.parquet", "s3://cut-off/run/stats.json"]  # fmt: skip
    assert client.get_object(Bucket="cut-off", Key="run/output.parquet")["Body"].read() == big.read_bytes()


def test_the_input_signature_of_objects_changes_when_one_is_rewritten_so_the_run_plans_again(tmp_path, s3_server):
    from shardgen.data.sources import input_signature

    client = s3_bucket(s3_server, "signed")
    client.put_object(Bucket="signed", Key="a.parquet", Body=parquet_bytes(make_rows(3)))
    run = config(tmp_path, ["s3://signed/*.parquet"], s3_server)
    before = input_signature(run.input)
    assert [p for p, *_ in before] == ["s3://signed/a.parquet"]
    client.put_object(Bucket="signed", Key="a.parquet", Body=parquet_bytes(make_rows(5)))
    assert input_signature(run.input) != before


def test_planning_objects_reads_their_footers_only_and_says_how_much(tmp_path, s3_server):
    """Objects of about 1 MB (incompressible text, 4 row groups): planning reads each one's footer, the
    last 64 KiB (Arrow's footer_read_size), not its rows. (1,000 objects: bench/s3_plan.py.)"""
    import random

    client = s3_bucket(s3_server, "footers")
    rng = random.Random(0)
    for i in range(3):
        rows = [{"id": f"o{i}-{j}", "text": "".join(rng.choices("abcdefghij", k=1000))} for j in range(1000)]
        buf = io.BytesIO()
        pq.write_table(pa.Table.from_pylist(rows), buf, row_group_size=250, compression="none")
        client.put_object(Bucket="footers", Key=f"data/part-{i}.parquet", Body=buf.getvalue())
    source = storage_source(["s3://footers/data/*.parquet"], s3_server)
    objects, read, size = source.objects_read
    assert objects == 3 and size == sum(f.size for f in source.files) > 3_000_000
    assert 0 < read <= 3 * 65536, "only the footers"
    assert [f.rows for f in source.files] == [1000] * 3 and source.files[0].row_groups == [250] * 4


def storage_source(patterns: list[str], endpoint: str):
    from shardgen.data.sources import ParquetSource

    return ParquetSource.scan(patterns, {"endpoint_url": endpoint})


def test_throttling_is_retried_and_a_denied_upload_prefix_is_named(tmp_path, s3_server):
    """Through a proxy that answers as a store under load, or with a policy that denies writes: the
    first two requests for each object get 503 SlowDown (the AWS SDK's standard retries back off and
    try again, so planning and reading succeed), and writes under ``denied/`` get 403."""
    from tests.s3faults import FaultProxy

    client = s3_bucket(s3_server, "faults")
    rows = make_rows(9)
    client.put_object(Bucket="faults", Key="data/part-0.parquet", Body=parquet_bytes(rows))
    with FaultProxy(s3_server, throttle=2) as proxy:
        source = storage_source(["s3://faults/data/*.parquet"], proxy.url)
        assert source.num_rows == 9 and proxy.throttled >= 2, proxy.seen
        (tmp_path / "plan").mkdir()
        read = [r for b in source.read([Segment(0, 0, 9)]) for r in b.to_pylist()]
        assert read == rows
    with FaultProxy(s3_server, deny="/faults/denied/") as proxy:
        said = storage.check_writable("s3://faults/denied/run/", {"endpoint_url": proxy.url})
        assert said.startswith("output.upload: cannot write under 's3://faults/denied/run/': ") and proxy.denied
        assert "ACCESS_DENIED" in said or "Access Denied" in said, said
        (tmp_path / "out.parquet").write_bytes(parquet_bytes(rows))
        with pytest.raises(StorageError, match=r"output.upload: cannot write 's3://faults/denied/run/out.parquet'"):
            storage.upload([(tmp_path / "out.parquet", "out.parquet")], "s3://faults/denied/run/",
                           {"endpoint_url": proxy.url}, tmp_path / "state.json")  # fmt: skip
        assert storage.check_writable("s3://faults/allowed/", {"endpoint_url": proxy.url}) is None


def test_a_compute_job_that_cannot_read_the_objects_is_named_with_its_node_before_any_generate_job(
    tmp_path, s3_server, monkeypatch
):
    """``shardgen reach-storage`` (the rule reach_storage, a job like the generate jobs but with no GPU):
    planned from the login node, then read from a node whose reads are refused (403)."""
    from shardgen.base.rundir import RunDir
    from shardgen.jobs.preflight import reach_storage
    from tests.s3faults import FaultProxy

    client = s3_bucket(s3_server, "reach")
    for i in range(2):
        client.put_object(Bucket="reach", Key=f"data/part-{i}.parquet", Body=parquet_bytes(make_rows(5, 10 * i)))
    with FaultProxy(s3_server) as proxy:
        run = config(tmp_path, ["s3://reach/data/*.parquet"], proxy.url)
        run_dir = RunDir(run.output.dir)
        run_dir.plan.mkdir(parents=True)
        run_dir.manifest.write_text(json.dumps(build_manifest(run)))
        monkeypatch.setenv("SLURM_JOB_ID", "4242")
        record = reach_storage(run, run_dir.manifest, run_dir.storage_reach)
        assert record["objects"] == ["s3://reach/data/part-0.parquet"] and record["slurm_job_id"] == "4242"
        assert json.loads(run_dir.storage_reach.read_text()) == record
        proxy.deny_reads = True
        with pytest.raises(InputError) as e:
            reach_storage(run, run_dir.manifest, tmp_path / "again.json")
    said = str(e.value)
    assert said.startswith("input: cannot read 's3://reach/data/part-0.parquet': ") and "Slurm job 4242" in said
    assert "the nodes that run the generate jobs must reach the endpoint" in said and "no generate job" in said


def same_size_versions(n: int) -> tuple[bytes, bytes]:
    """Two Parquet objects of ``n`` rows in row groups of 7 with the same size and layout, whose text
    differs (a same-length typo fix): only their ETags tell them apart."""
    out = []
    for version in ("v1", "v2"):
        # (a column of 4 KB a row that the read leaves out: the row groups' other columns are apart, each
        # read when its rows are, not with the footer or the first row group's)
        rows = [{"id": f"r{i:05d}", "pad": "x" * 4000, "topic": f"{version} text {i:05d}"} for i in range(n)]
        buf = io.BytesIO()
        pq.write_table(pa.Table.from_pylist(rows), buf, row_group_size=7, compression="none", use_dictionary=False)
        out.append(buf.getvalue())
    assert len(out[0]) == len(out[1]) and out[0] != out[1]
    return out[0], out[1]


def test_an_object_rewritten_in_place_with_the_same_size_is_another_input_for_its_shards(
    tmp_path, s3_server, monkeypatch
):
    from shardgen import config as cfg
    from shardgen.data.identity import shard_fingerprint

    monkeypatch.setattr(cfg, "engine_version", lambda: "0.32.0")
    client = s3_bucket(s3_server, "rewritten")
    v1, v2 = same_size_versions(20)
    client.put_object(Bucket="rewritten", Key="data/part-0.parquet", Body=v1)
    run = config(tmp_path, ["s3://rewritten/data/*.parquet"], s3_server)
    before = Manifest(build_manifest(run))
    client.put_object(Bucket="rewritten", Key="data/part-0.parquet", Body=v2)
    after = Manifest(build_manifest(run))
    old, new = before.data["source"]["files"][0], after.data["source"]["files"][0]
    assert (old["path"], old["size"], old["mtime_ns"]) == (new["path"], new["size"], new["mtime_ns"])
    assert old["etag"] != new["etag"]
    assert shard_fingerprint(run, before, before.shards[0]) != shard_fingerprint(run, after, after.shards[0])


def test_an_object_rewritten_while_it_is_read_fails_the_read_rather_than_yield_rows_of_the_new_version(
    tmp_path, s3_server
):
    """The HEAD before a read and the ranged reads after it are separate requests: an object rewritten
    between two row groups must not give the rows after it from the new bytes (same size, same layout:
    they would decode)."""
    client = s3_bucket(s3_server, "mid-read")
    v1, v2 = same_size_versions(35)  # 5 row groups
    client.put_object(Bucket="mid-read", Key="part-0.parquet", Body=v1)
    source = storage_source(["s3://mid-read/part-0.parquet"], s3_server)
    batches = source.read([Segment(0, 0, 35)], batch_rows=7, columns=["id", "topic"])
    first = next(batches).to_pylist()
    assert [r["topic"] for r in first] == [f"v1 text {i:05d}" for i in range(7)]
    client.put_object(Bucket="mid-read", Key="part-0.parquet", Body=v2)
    with pytest.raises(InputError, match=r"'s3://mid-read/part-0.parquet' changed while it was read \(.*\); rerun the"):
        for batch in batches:
            assert all(r["topic"].startswith("v1") for r in batch.to_pylist()), "a row of the new version"
    # (the same read started after the rewrite: refused before any row, as changed after planning)
    with pytest.raises(InputError, match=r"'s3://mid-read/part-0.parquet' changed after planning"):
        next(source.read([Segment(0, 0, 35)], batch_rows=7))


def test_an_interrupted_upload_leaves_the_object_of_the_upload_before_it_as_it_was(tmp_path, s3_server, monkeypatch):
    client = s3_bucket(s3_server, "kept")
    local = tmp_path / "output.parquet"
    local.write_bytes(b"v1" * 1000)
    state = tmp_path / "uploaded.json"
    assert storage.upload([(local, "output.parquet")], "s3://kept/run/", {"endpoint_url": s3_server}, state)[
        "uploaded"] == ["s3://kept/run/output.parquet"]  # fmt: skip
    v1 = local.read_bytes()
    local.write_bytes(bytes(range(256)) * 1024)  # v2: 256 KiB, 4 chunks
    monkeypatch.setattr(storage, "CHUNK", 64 << 10)
    real_open, opened = open, []

    class Failing:
        """The local file, whose read fails after its first chunk (a disk error, a signal)."""

        def __init__(self, *args):
            self.f = real_open(*args)

        def read(self, n):
            if self.f.tell() > 0:
                raise OSError("read error")
            return self.f.read(n)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

    def failing(path, mode="r"):  # the second open of the file: the upload's, after its checksum's
        opened.append(path)
        return Failing(path, mode) if opened.count(local) == 2 else real_open(path, mode)

    monkeypatch.setattr(storage, "open", failing, raising=False)
    with pytest.raises((OSError, StorageError)):
        storage.upload([(local, "output.parquet")], "s3://kept/run/", {"endpoint_url": s3_server}, state)
    assert opened.count(local) == 2, "cut off while uploading"
    assert client.get_object(Bucket="kept", Key="run/output.parquet")["Body"].read() == v1
    keys = [o["Key"] for o in client.list_objects_v2(Bucket="kept").get("Contents", [])]
    assert [k for k in keys if not k.endswith("/")] == ["run/output.parquet"], "nothing else left behind"
    monkeypatch.undo()
    assert storage.upload([(local, "output.parquet")], "s3://kept/run/", {"endpoint_url": s3_server}, state)[
        "uploaded"] == ["s3://kept/run/output.parquet"]  # fmt: skip
    assert client.get_object(Bucket="kept", Key="run/output.parquet")["Body"].read() == local.read_bytes()


@pytest.mark.parametrize(
    ("bucket", "pattern"),
    [
        ("globs-1", "data/**/*.parquet"),
        ("globs-2", "data/part-[!1].parquet"),
        ("globs-3", "data/**"),
        ("globs-4", "*/*/part-?.parquet"),
    ],
)
def test_an_s3_glob_selects_the_objects_the_same_glob_selects_of_the_same_files_on_disk(
    tmp_path, s3_server, bucket, pattern
):
    import os

    from shardgen.data.sources import expand_patterns

    client = s3_bucket(s3_server, bucket)
    keys = ["data/part-1.parquet", "data/part-2.parquet", "data/a/part-3.parquet", "data/a/b/part-4.parquet",
            "data/.hidden.parquet", "data/.cache/part-5.parquet"]  # fmt: skip
    for key in keys:
        client.put_object(Bucket=bucket, Key=key, Body=b"x")
        (tmp_path / key).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / key).write_bytes(b"x")
    remote = storage.expand([f"s3://{bucket}/{pattern}"], {"endpoint_url": s3_server}, "input.parquet")
    local = expand_patterns([os.path.join(tmp_path, pattern)], "input.parquet")
    assert [u.removeprefix(f"s3://{bucket}/") for u in remote] == [os.path.relpath(p, tmp_path) for p in local]
