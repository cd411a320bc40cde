"""The commands of docs/deployment.md that are marked `# tested: ...` run as written.

The guide's blocks run in order in one scratch directory laid out like the
checkout (config/, profiles/, the demo model, data), so each command sees
what the guide's earlier steps left: the first dry runs find nothing
planned, the preflight step plans and checks for real (login-node steps
only), and the dry runs after it list every generate_shard job with the
resources it would ask Slurm for. Nothing is ever submitted: a dry-run block
must say -n, and a local-steps block may only name login-node targets or
--unlock. What the test changes, because this machine has no cluster and no
hub: the profiles' SET_ME placeholders get values (as a user edits them)
before a command that does not set them on its command line, and a file
block's hub model becomes the demo model.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import jinja2
import jinja2.meta
import yaml

from shardgen.profile import find_unset, raw_value, read_profile
from tests.conftest import make_rows, write_parquet
from tests.integration.workflow import run_bounded
from tests.unit.test_profiles import filled, job_counts

ROOT = Path(__file__).resolve().parents[2]
GUIDE = ROOT / "docs" / "deployment.md"
BIN = Path(sys.executable).parent
DEMO_MODEL = ROOT / "models" / "SmolLM2-135M-Instruct"
# Targets that run only on the login node (local rules): never a Slurm job.
LOCAL_TARGETS = {"plan_shards", "fetch_model", "preflight"}
KINDS = {"dry-run", "local-steps", "file"}


@dataclass
class Block:
    kind: str
    arg: str
    lang: str
    body: str
    line: int
    commands: list[str] = field(default_factory=list)


def marked_blocks(text: str) -> list[Block]:
    """The fenced blocks whose first line is ``# tested: KIND [ARG]``, in order."""
    blocks = []
    for m in re.finditer(r"^```(\w*)\n(.*?)^```", text, re.M | re.S):
        lang, body = m.group(1), m.group(2)
        first, _, rest = body.partition("\n")
        tag = re.fullmatch(r"# tested: (\S+)(?: (\S+))?", first.strip())
        if not tag:
            continue
        block = Block(tag.group(1), tag.group(2) or "", lang, rest, text[: m.start()].count("\n") + 1)
        joined = re.sub(r"\\\n\s*", " ", rest)
        block.commands = [ln.strip() for ln in joined.splitlines() if ln.strip() and not ln.lstrip().startswith("#")]
        blocks.append(block)
    return blocks


def test_guide_marks_dry_runs_local_steps_and_files():
    blocks = marked_blocks(GUIDE.read_text())
    assert {b.kind for b in blocks} == KINDS, "every kind of tested block is used"
    for b in blocks:
        assert b.kind in KINDS, f"line {b.line}: unknown kind {b.kind!r}"
        if b.kind == "file":
            assert b.arg and b.lang == "yaml", f"line {b.line}"
        else:
            assert b.lang == "bash" and b.commands, f"line {b.line}"
    assert sum(len(b.commands) for b in blocks if b.kind == "dry-run") >= 4


@dataclass
class Command:
    env: dict[str, str]
    args: list[str]  # after `snakemake`

    @classmethod
    def parse(cls, line: str) -> Command:
        words = shlex.split(line)
        env = {}
        while words and re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", words[0]):
            k, _, v = words.pop(0).partition("=")
            env[k] = v
        assert words and words[0] == "snakemake", f"not a snakemake command: {line}"
        return cls(env, words[1:])

    def option(self, name: str) -> list[str]:
        """The values of an option that takes one or more (up to the next option)."""
        if name not in self.args:
            return []
        values = []
        for word in self.args[self.args.index(name) + 1 :]:
            if word.startswith("-"):
                break
            values.append(word)
        return values

    @property
    def targets(self) -> list[str]:
        out, skip = [], False
        for word in self.args:
            if word.startswith("-"):
                skip = word in ("--profile", "--configfile", "--default-resources", "--set-resources", "--directory")
            elif not skip:
                out.append(word)
        return out


def demo_like_data(directory: Path) -> None:
    rows = make_rows(40)
    for i, r in enumerate(rows):
        r["style"] = ["one sentence", "a short haiku"][i % 2]
    write_parquet(directory / "part-0.parquet", rows[:20])
    write_parquet(directory / "part-1.parquet", rows[20:])


def data_for(config: dict, workdir: Path) -> None:
    """Parquet files where the config's input patterns point, with the columns its template and id use."""
    env = jinja2.Environment()
    columns = sorted(jinja2.meta.find_undeclared_variables(env.parse(config["prompt"]["template"])))
    id_column = config["input"].get("id_column")
    rows = [{**{c: f"{c} {i}: the product broke after a week" for c in columns}} for i in range(30)]
    if id_column:
        for i, r in enumerate(rows):
            r[id_column] = f"id-{i:04d}"
    for pattern in config["input"]["parquet"]:
        write_parquet(workdir / pattern.replace("*", "part-0"), rows)


class Guide:
    """A scratch directory laid out like the checkout, where the guide's commands run."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        (workdir / "config").symlink_to(ROOT / "config", target_is_directory=True)
        (workdir / "models").symlink_to(ROOT / "models", target_is_directory=True)
        shutil.copytree(ROOT / "profiles", workdir / "profiles")
        demo_like_data(workdir / "data" / "demo")
        self.filled: set[str] = set()

    def write_file(self, block: Block) -> None:
        config = yaml.safe_load(block.body)
        if not Path(config["model"]["model"]).is_dir():
            config["model"]["model"] = str(DEMO_MODEL)  # no hub here; the rest as the guide wrote it
        (self.workdir / block.arg).write_text(yaml.safe_dump(config, sort_keys=False))
        data_for(config, self.workdir)

    def profile(self, cmd: Command) -> Path:
        (name,) = cmd.option("--profile")
        profile = self.workdir / name
        overrides = cmd.option("--default-resources") or cmd.option("--set-resources")
        if not overrides and name not in self.filled:
            # the user sets the placeholders once (section 2 of the guide)
            conf = profile / "config.yaml"
            conf.write_text(filled(conf.read_text()))
            self.filled.add(name)
        return profile

    def config(self, cmd: Command) -> dict:
        (configfile,) = cmd.option("--configfile") or ["config/config.yaml"]
        return yaml.safe_load((self.workdir / configfile).read_text())

    def run(self, cmd: Command) -> subprocess.CompletedProcess:
        env = dict(os.environ, PATH=f"{BIN}:{os.environ['PATH']}", **cmd.env)
        argv = [str(BIN / "snakemake"), "--snakefile", str(ROOT / "Snakefile"), *cmd.args]
        return run_bounded(argv, workdir=self.workdir, cwd=self.workdir, env=env)


def expected_jobs(out_dir: Path, config: dict) -> dict[str, int]:
    """What a dry run must list, given what earlier steps left in the output directory."""
    plan = out_dir / "plan"
    jobs = {"merge_shards": 1, "plot_stats": 1, "all": 1}
    if not (plan / "model.json").exists():  # (in the DAG before the plan is made: the merge reads it)
        jobs["fetch_model"] = 1
    if not (plan / "manifest.json").exists():
        return {"plan_shards": 1, **jobs}
    shards = list(yaml.safe_load((plan / "manifest.json").read_text())["shards"])
    if not (plan / "preflight.json").exists():
        jobs["preflight"] = 1
    jobs["generate_shard"] = len(shards)
    return jobs


def generate_resources(output: str) -> list[dict[str, str]]:
    """The resources line of every generate_shard job in a dry run's output."""
    found = []
    for m in re.finditer(r"^rule generate_shard:\n(.*?)^Shell command", output, re.M | re.S):
        line = re.search(r"^\s+resources: (.*)$", m.group(1), re.M).group(1)
        found.append(dict(item.split("=", 1) for item in line.split(", ")))
    return found


def effective_resources(guide: Guide, cmd: Command, profile: Path) -> dict[str, str]:
    """The partition and GPU type a generate job should get: the command line's, else the profile's."""
    saved = {k: os.environ.get(k) for k in cmd.env}
    os.environ.update(cmd.env)
    try:
        p = read_profile(profile)
    finally:
        for k, v in saved.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)
    res = {k: raw_value(v) for k, v in p["default-resources"].items()}
    if cmd.option("--default-resources"):
        res = dict(item.split("=", 1) for item in cmd.option("--default-resources"))
    per_rule = p["set-resources"].get("generate_shard", {})
    if cmd.option("--set-resources"):
        per_rule = {k.split(":", 1)[1]: v for k, v in (i.split("=", 1) for i in cmd.option("--set-resources"))}
    res.update({k: raw_value(v) for k, v in per_rule.items()})
    assert not find_unset(res), f"{profile}: placeholders left for {cmd.args}"
    return {k: v for k, v in res.items() if k in ("slurm_partition", "gpu_model", "constraint", "qos")}


def check_dry_run(guide: Guide, block: Block, cmd: Command) -> None:
    assert "-n" in cmd.args or "--dry-run" in cmd.args, f"line {block.line}: a dry-run block must say -n"
    profile = guide.profile(cmd)
    config = guide.config(cmd)
    out_dir = guide.workdir / config.get("output", {}).get("dir", "results")
    expected = expected_jobs(out_dir, config)
    r = guide.run(cmd)
    out = r.stdout + r.stderr
    where = f"docs/deployment.md line {block.line}: {' '.join(cmd.args)}"
    assert r.returncode == 0, f"{where}\n{out[-4000:]}"
    assert "This was a dry-run" in out
    assert job_counts(out) == expected, f"{where}\n{out[-3000:]}"
    jobs = generate_resources(out)
    assert len(jobs) == expected.get("generate_shard", 0)
    want = effective_resources(guide, cmd, profile)
    gpus = config["model"].get("tensor_parallel_size", 1) * config["model"].get("pipeline_parallel_size", 1)
    for resources in jobs:
        assert resources["gpu"] == str(gpus) and resources["nodes"] == "1" and resources["tasks_per_gpu"] == "0"
        for key, value in want.items():
            assert resources.get(key) == value, f"{where}: {key}={resources.get(key)}, expected {value}"


def check_local_steps(guide: Guide, block: Block, cmd: Command) -> None:
    targets = set(cmd.targets)
    assert "--unlock" in cmd.args or (targets and targets <= LOCAL_TARGETS), (
        f"line {block.line}: a local-steps command may only run {sorted(LOCAL_TARGETS)} or --unlock"
    )
    guide.profile(cmd)
    config = guide.config(cmd)
    out_dir = guide.workdir / config.get("output", {}).get("dir", "results")
    r = guide.run(cmd)
    out = r.stdout + r.stderr
    where = f"docs/deployment.md line {block.line}: {' '.join(cmd.args)}"
    assert r.returncode == 0, f"{where}\n{out[-4000:]}"
    assert "submitted with SLURM jobid" not in out and "rule generate_shard" not in out
    assert not (out_dir / "shards").exists()
    if "preflight" in targets:
        assert (out_dir / "plan" / "preflight.json").exists()
        assert "preflight: ok" in out, out[-3000:]


def test_guide_commands_marked_tested_run_as_written(tmp_path, model_dir):
    guide = Guide(tmp_path)
    ran = []
    for block in marked_blocks(GUIDE.read_text()):
        if block.kind == "file":
            guide.write_file(block)
            continue
        for line in block.commands:
            cmd = Command.parse(line)
            (check_dry_run if block.kind == "dry-run" else check_local_steps)(guide, block, cmd)
            ran.append((block.kind, line))
    assert [k for k, _ in ran].count("local-steps") >= 2
    # the last dry run came after the preflight: it listed the generate jobs
    assert any("slurm-gpu-types" in line for _, line in ran)
