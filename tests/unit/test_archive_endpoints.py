"""A job's archive endpoint must be one of the admin's: compared as an origin, nothing more."""

from __future__ import annotations

import pytest

from rankwatch.operator.recovery.archive_endpoints import origin, refusal

ALLOWED = (origin("http://minio.storage.svc:9000"), origin("https://s3.example.com"))


def test_origins_spell_out_the_port_and_ignore_case():
    assert origin("https://S3.Example.com/") == "https://s3.example.com:443"
    assert origin("http://[::1]:9000") == "http://[::1]:9000"


@pytest.mark.parametrize(
    "url",
    ["ftp://x", "http://user:pw@minio:9000", "http://minio:9000/../admin", "http://minio:9000/?x=1", "minio:9000",
     "http://minio:99999"],
)  # fmt: skip
def test_anything_but_a_bare_http_origin_is_refused(url):
    with pytest.raises(ValueError):
        origin(url)


def test_only_listed_endpoints_or_aws_are_allowed():
    assert refusal(None, ()) is None, "unset: AWS S3"
    assert refusal("http://minio.storage.svc:9000/", ALLOWED) is None
    assert refusal("https://s3.example.com:443", ALLOWED) is None
    scan = refusal("http://10.0.0.7:22", ALLOWED)
    assert scan and "10.0.0.7:22 is not one of the operator's archive endpoints" in scan
    assert "ask the operator's admin" in scan
    assert refusal("http://minio.storage.svc:9001", ALLOWED), "another port of an allowed host is another endpoint"
    assert "path" in (refusal("http://minio.storage.svc:9000/a/../b", ALLOWED) or "")
    assert refusal("http://minio.storage.svc:9000", ()), "an empty allow-list allows no endpoint"
