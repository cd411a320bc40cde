"""Credentials in URLs: refused anywhere in the config (``trust.find_credentials``), by its key path
and never quoted, and kept out of what object storage's messages say of a URL (``storage.redact``)."""

from __future__ import annotations

import pytest

from shardgen import config as cfg
from shardgen import trust
from shardgen.base import storage
from shardgen.errors import ConfigError, InputError
from tests.conftest import S3_ENV

SECRET = "Sh4rdgenTestSecret0123"


@pytest.mark.parametrize(
    "value",
    [
        f"https://me:{SECRET}@data.example/x.parquet",
        f"https://me:pa/{SECRET}@data.example/x.parquet",  # a '/' in the password (no valid URL, but written)
        f"https://{SECRET}@data.example/x.parquet",  # a token as the whole userinfo
        f"http://{SECRET}@127.0.0.1:9000",
        f"s3://AKIDEXAMPLE:{SECRET}@bucket/x.parquet",
        f"s3://b/x.parquet?X-Amz-Security-Token={SECRET}",
        f"https://b.s3.amazonaws.com/x?X-Amz-Algorithm=AWS4-HMAC-SHA256&X-Amz-Credential={SECRET}",
        f"https://b.s3.amazonaws.com/x?AWSAccessKeyId={SECRET}&Expires=1",
        f"https://acct.blob.core.windows.net/c/x?sv=2022&sig={SECRET}",
        f"https://api.example/v1?access_token={SECRET}",
        f"https://api.example/v1?client_secret={SECRET}",
    ],
)
def test_a_credential_in_a_url_is_found_and_named_by_its_key_never_quoted(value):
    found = trust.find_credentials({"input": {"hf": {"data_files": [value]}}})
    assert len(found) == 1 and found[0].startswith("input.hf.data_files[0]: the value looks like"), found
    assert SECRET not in found[0]


@pytest.mark.parametrize(
    "value",
    [
        "s3://bucket/data/part-0.parquet",
        "s3://bucket/data/**/*.parquet",
        "git@github.com:my-org/repo.git",
        "ssh://git@github.com/my-org/repo.git",  # a user name, no secret
        "Write to bob@example.com about https://example.com/docs today.",
        "https://medium.com/@someone/a-post",
        "http://localhost:8000/docs/me@example.com",  # a port, and an '@' in the path
        "https://example.com/x?ref=a@b&page=2",
        "https://example.com/search?q=token&key_id=3&sort_key=name",
        "{{ user }}@{{ host }}: a template",
    ],
)
def test_urls_and_addresses_without_credentials_are_not_refused(value):
    assert trust.find_credentials({"prompt": {"system": value}, "input": {"parquet": [value]}}) == []


def test_an_endpoint_with_credentials_in_its_url_is_refused_before_anything_naming_the_key():
    raw = {
        "input": {"parquet": ["s3://b/x.parquet"], "storage_options": {"endpoint_url": f"https://me:p/{SECRET}@s3.x"}},
        "prompt": {"template": "{{ topic }}"},
        "model": {"model": "m"},
    }
    with pytest.raises(ConfigError, match=r"input.storage_options.endpoint_url: the value looks like") as e:
        cfg.validate(raw)
    assert SECRET not in str(e.value)


def test_redact_keeps_a_url_readable_without_its_credentials():
    url = f"https://me:pa/{SECRET}@host.example:9000/p/x.parquet?X-Amz-Security-Token={SECRET}&part=1"
    assert storage.redact(url) == "https://***@host.example:9000/p/x.parquet?X-Amz-Security-Token=***&part=1"
    assert storage.redact(f"at https://{SECRET}@h/x and s3://b/k") == "at https://***@h/x and s3://b/k"
    assert storage.redact("s3://b/data/part-[!1].parquet") == "s3://b/data/part-[!1].parquet"


def test_storage_messages_never_quote_a_credential_of_the_endpoint(monkeypatch):
    """Where a URL reaches storage without the config's check (a caller of its own): the endpoint, as the
    messages name it, and the client's endpoint, without its userinfo (credentials come from the environment)."""
    for key, value in S3_ENV.items():  # (credentials where AWS tools read them: none looked up elsewhere)
        monkeypatch.setenv(key, value)
    monkeypatch.setattr(storage, "MAX_ATTEMPTS", 1)
    options = {"endpoint_url": f"http://me:{SECRET}@127.0.0.1:9"}
    with pytest.raises(InputError) as e:
        storage.expand(["s3://named/a.parquet"], options, "input.parquet")
    said = str(e.value)
    assert "the endpoint http://***@127.0.0.1:9" in said and SECRET not in said, said
    assert SECRET not in (storage.check_writable("s3://named/run/", options) or "")
