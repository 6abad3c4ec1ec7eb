"""`rankwatch describe`: the same description for a TrainingJob (its status) and a job of another kind
(the annotations rankwatch wrote on it), and clear errors for what it cannot describe."""

from __future__ import annotations

import datetime
import json

import pytest

from rankwatch.describe import DescribeError, kind_named, parse_reference, render

NOW = datetime.datetime(2026, 11, 28, 12, 0, tzinfo=datetime.UTC)
DIAGNOSIS = {
    "active": True,
    "kind": "Straggler",
    "ranks": [5],
    "nodes": ["gpu-node-1"],
    "pods": ["bert-1-x7"],
    "confidence": 0.93,
    "summary": "rank 5 (tp 1, dp 1, pp 0) on gpu-node-1 is 31% slower",
    "cause": "gpu",
    "causeEvidence": "kernels 31% longer",
    "time": "2026-11-28T11:58:00Z",
    "report": "bert-rankwatch-job-report",
    "remediation": "cordoned and tainted gpu-node-1",
    "alertedTime": "2026-11-28T11:58:02Z",
}
EVENT = {
    "metadata": {"creationTimestamp": "2026-11-28T11:58:01Z"},
    "type": "Warning",
    "reason": "Straggler",
    "message": "rank 5 (tp 1, dp 1, pp 0) on gpu-node-1 is 31% slower",
    "lastTimestamp": "2026-11-28T11:58:00Z",
    "reportingComponent": "rankwatch-operator",
}


def test_a_job_of_another_kind_is_described_from_what_rankwatch_wrote_on_it():
    job = {
        "metadata": {
            "name": "bert",
            "namespace": "team-b",
            "annotations": {
                "rankwatch.io/diagnosis": json.dumps(DIAGNOSIS),
                "rankwatch.io/health": "Degraded",
                "rankwatch.io/suspect-nodes": "gpu-node-1",
                "rankwatch.io/step-time": "812.0ms",
            },
        }
    }
    text = render(kind_named("job"), job, [EVENT], NOW)
    assert "Kind:         Job (batch/v1)" in text and "Health:       Degraded" in text
    assert "Suspects:     gpu-node-1" in text and "Step time:    812.0ms" in text
    assert "  Kind:        Straggler" in text and "  Ranks:       5" in text and "  Confidence:  0.93" in text
    assert "  Remediation: cordoned and tainted gpu-node-1" in text and "  Alerted:     2026-11-28T11:58:02Z" in text
    assert "kubectl get configmap -n team-b bert-rankwatch-job-report" in text
    [header, row] = text.split("Events:\n")[1].splitlines()
    assert header.split() == ["Type", "Reason", "Age", "From", "Message"]
    assert row.split()[:4] == ["Warning", "Straggler", "2m", "rankwatch-operator"] and row.endswith("31% slower")


def test_a_trainingjob_is_described_from_its_status_alike():
    status = {"health": "Degraded", "suspects": "gpu-node-1", "stepTime": "812.0ms", "diagnosis": DIAGNOSIS}
    job = {"metadata": {"name": "bert", "namespace": "team-b", "annotations": {}}, "status": status}
    other = {"metadata": {**job["metadata"], "annotations": {
        "rankwatch.io/diagnosis": json.dumps(DIAGNOSIS), "rankwatch.io/health": "Degraded",
        "rankwatch.io/suspect-nodes": "gpu-node-1", "rankwatch.io/step-time": "812.0ms"}}}  # fmt: skip
    as_trainingjob = render(kind_named("tj"), job, [EVENT], NOW).splitlines()
    as_job = render(kind_named("jobs"), other, [EVENT], NOW).splitlines()
    assert as_trainingjob[2] == "Kind:         TrainingJob (rankwatch.io/v1alpha1)"
    assert as_trainingjob[:2] + as_trainingjob[3:] == as_job[:2] + as_job[3:], "one description for every kind"


def test_a_job_with_nothing_found_says_so():
    job = {"metadata": {"name": "quiet", "namespace": "a", "annotations": {"rankwatch.io/diagnosis": "{not json"}}}
    text = render(kind_named("JobSet"), job, [], NOW)
    assert "Diagnosis:    <none>" in text and "Events:\n  <none>" in text, "a forged annotation is no diagnosis"


@pytest.mark.parametrize(
    ("reference", "error"),
    [
        (
            "deployment/x",
            "unknown kind 'deployment'; rankwatch describes TrainingJob, TrainJob, JobSet, VolcanoJob, PyTorchJob, Job",
        ),
        ("jobset", "expected KIND/NAME"),
        ("jobset/a/b", "expected KIND/NAME"),
    ],
)
def test_what_cannot_be_described_is_refused_with_what_to_type(reference, error):
    with pytest.raises(DescribeError, match=error):
        parse_reference(reference)


def test_volcanos_job_is_told_from_a_batch_job_by_the_name_rankwatch_gives_it():
    assert kind_named("jobs").api_version == "batch/v1" and kind_named("job").api_version == "batch/v1"
    assert kind_named("vcjob").api_version == kind_named("VolcanoJob").api_version == "batch.volcano.sh/v1alpha1"


def test_a_groups_restart_is_described_with_its_lever():
    outcome = "suspended the Job to end every pod, resumed once they are gone"

    def job(diagnosis: dict) -> dict:
        annotations = {"rankwatch.io/diagnosis": json.dumps(diagnosis)}
        return {"metadata": {"name": "bert", "namespace": "team-b", "annotations": annotations}}

    text = render(kind_named("job"), job({**DIAGNOSIS, "active": False, "restart": outcome}), [], NOW)
    assert "  Active:      false" in text and f"  Restart:     {outcome}" in text
    assert "Restart:" not in render(kind_named("job"), job(DIAGNOSIS), [], NOW), "none before one was looked at"
