"""The archive target a job names: a region botocore cannot use or a prefix of more than one path
segment is refused with a message naming it (the CRD refuses both; a job stored under an older CRD
may carry them), never an exception the recovery does not expect."""

from __future__ import annotations

import pytest

from rankwatch.operator.recovery.archive import ArchiveFailed, check_target, key_prefix
from rankwatch.operator.spec import S3Archive


@pytest.mark.parametrize(
    ("field", "value", "says"),
    [
        ("region", "eu west 1", r"region 'eu west 1' is not a region name"),
        ("region", "-eu-west-1", r"is not a region name"),
        ("prefix", "rankwatch/team-b/llama-70b", r"prefix .* is not one path segment"),
        ("prefix", "..", r"is not one path segment"),
        ("prefix", "", r"is not one path segment"),
    ],
)
def test_a_region_or_prefix_the_operator_cannot_use_is_refused_naming_it(field, value, says):
    target = S3Archive("traces", "s3", **{field: value})
    with pytest.raises(ArchiveFailed, match=says):
        key_prefix(target, "team-a", "llama", "uid", 10, "2026-11-28T11:00:00Z", "Hang")


def test_a_jobs_keys_are_below_its_own_namespace_and_name():
    target = S3Archive("traces", "s3", region="eu-west-1", prefix="team.a_1")
    check_target(target)
    key = key_prefix(target, "team-a", "llama", "uid", 10, "2026-11-28T11:00:00Z", "Hang")
    assert key == "team.a_1/team-a/llama/uid/attempt-10/20261128T110000Z-hang"
