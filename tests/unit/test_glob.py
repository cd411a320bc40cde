"""The glob of ``s3://`` input selects the objects that ``glob.glob(pattern, recursive=True)`` selects of
the same tree on local disk (``storage.glob_match``): case by case, and over generated trees and patterns.
(Through the S3 server: tests/unit/test_storage.py.)"""

from __future__ import annotations

import glob
import os
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shardgen.base import storage
from shardgen.base.storage import glob_match
from shardgen.errors import InputError
from tests.conftest import S3_ENV

TREE = [
    "data/part-1.parquet",
    "data/part-2.parquet",
    "data/sub/part-3.parquet",
    "data/sub/deeper/part-4.parquet",
    "data/.hidden.parquet",
    "data/.cache/part-5.parquet",
    "data/sub/.cache/part-6.parquet",
    "data/notes.txt",
    "other/part-1.parquet",
    "top.parquet",
]


def write_tree(root: Path, keys: list[str]) -> None:
    for key in keys:
        (root / key).parent.mkdir(parents=True, exist_ok=True)
        (root / key).write_text(key)


def on_disk(root: Path, pattern: str) -> list[str]:
    """The files ``glob.glob`` selects (what ``input.parquet`` takes of local files), relative to ``root``."""
    found = glob.glob(pattern, root_dir=root, recursive=True)
    # (os.path.join, not Path: 'a/' of a file 'a' is no file, as input.parquet's expansion sees it)
    return sorted({os.path.normpath(p) for p in found if os.path.isfile(os.path.join(root, p))})


@pytest.mark.parametrize(
    "pattern",
    [
        "data/**/*.parquet",  # zero levels too: data/part-1.parquet (issue: S3 took only those one level down)
        "data/part-[!1].parquet",  # [!...] negates (issue: S3 read it as a regex class, selecting part-1)
        "data/part-[1].parquet",
        "data/part-[!a-z].parquet",
        "data/*",
        "data/**",
        "data/**.parquet",  # ** not alone in a component acts as *
        "data/sub**/*.parquet",
        "**/*.parquet",
        "**/part-1.parquet",
        "**",
        "*/*.parquet",
        "*/**/part-?.parquet",
        "data/.*",  # a component starting with '.' matches hidden names
        "data/.*/*.parquet",
        "data/**/.cache/*.parquet",  # a literal hidden component below **
        "data/*/*/*",
        "data/?ub/*.parquet",
        "data/[s]ub/deeper/*",
        "data/**/**/*.parquet",
        "data/*/",  # a trailing slash selects directories only: no file
        "data/part-[.parquet",  # an unclosed [ is literal
    ],
)
def test_the_glob_of_objects_selects_what_glob_selects_on_disk(tmp_path, pattern):
    write_tree(tmp_path, TREE)
    assert sorted(k for k in TREE if glob_match(pattern, k)) == on_disk(tmp_path, pattern)


def test_the_two_globs_of_the_issue_select_all_four_files_and_part_2():
    keys = ["data/part-1.parquet", "data/part-2.parquet", "data/a/part-3.parquet", "data/a/b/part-4.parquet"]
    assert [k for k in keys if glob_match("data/**/*.parquet", k)] == keys
    assert [k for k in keys if glob_match("data/part-[!1].parquet", k)] == ["data/part-2.parquet"]


def test_a_pattern_in_a_buckets_name_is_refused_naming_it(monkeypatch):
    for key, value in S3_ENV.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(InputError, match=r"input.parquet: 's3://my-\*/x.parquet' has a pattern in its bucket's name"):
        storage.expand(["s3://my-*/x.parquet"], {"endpoint_url": "http://127.0.0.1:9"}, "input.parquet")


# Small trees and patterns over few names, so that patterns often match: names with a dot first, brackets,
# a '-' and '!' (negation, ranges).
NAMES = ["a", "b", "ab", ".a", "a.p", "b.p", "-", "!"]
KEYS = st.lists(st.sampled_from(NAMES), min_size=1, max_size=4).map("/".join)
PIECES = ["a", "b", ".", "p", "*", "?", "[ab]", "[!a]", "[a-b]", "[.]", "[!.]", "!", "-", "["]
COMPONENT = st.one_of(
    st.just("**"),
    st.lists(st.sampled_from(PIECES), min_size=1, max_size=3).map("".join).filter(lambda c: c not in (".", "..")),
)
PATTERNS = st.lists(COMPONENT, min_size=1, max_size=4).map("/".join)


def consistent(keys: list[str]) -> list[str]:
    """The keys a local tree can hold: none that is also another one's directory."""
    dirs = {"/".join(k.split("/")[:i]) for k in keys for i in range(1, k.count("/") + 1)}
    return sorted({k for k in keys if k not in dirs})


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(keys=st.lists(KEYS, min_size=1, max_size=8).map(consistent), pattern=PATTERNS)
def test_generated_globs_select_the_same_keys_as_glob_on_the_same_tree(tmp_path_factory, keys, pattern):
    root = tmp_path_factory.mktemp("tree")
    write_tree(root, keys)
    assert sorted(k for k in keys if glob_match(pattern, k)) == on_disk(root, pattern)
