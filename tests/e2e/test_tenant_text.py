"""A job's own text where the operator writes it in the API server: Events and status. A newline or an
escape sequence in it (a sidecar's error body, a frame's function name) stays inside its field, shown
as ``\\n``, and the field is bounded."""

from __future__ import annotations

import kubernetes
import pytest

from rankwatch.operator import api as names
from rankwatch.operator import events
from rankwatch.operator.recovery import attempts

pytestmark = pytest.mark.e2e

FORGED = "\n2026-11-28 11:00:00Z CIRCUIT BREAKER OPEN: 40 nodes uncordoned\x1b[2J\u202e"


def make_job(api, namespace: str, archive: dict | None = None) -> dict:
    manifest = {
        "apiVersion": names.API_VERSION,
        "kind": names.KIND,
        "metadata": {"name": "hostile"},
        "spec": {
            "replicas": 1,
            "nprocPerNode": 1,
            "template": {"spec": {"containers": [{"name": "trainer", "image": "trainer:1"}]}},
            **({"tracing": {"archive": archive}} if archive else {}),
        },
    }
    return kubernetes.client.CustomObjectsApi(api).create_namespaced_custom_object(
        names.GROUP, names.VERSION, namespace, names.PLURAL, manifest
    )


def test_a_jobs_text_in_an_event_and_in_the_status_stays_in_its_field(api, unwatched_namespace):
    job = make_job(api, unwatched_namespace)
    events.post_job_event(job, "Warning", "EvidenceNotKept", "attempt 0: sidecar said " + FORGED * 100, kube=api)
    posted = kubernetes.client.CoreV1Api(api).list_namespaced_event(unwatched_namespace).items
    (message,) = [event.message for event in posted if event.reason == "EvidenceNotKept"]
    assert message.startswith("attempt 0: sidecar said \\n2026-11-28 11:00:00Z CIRCUIT BREAKER OPEN")
    assert not set(message) & {"\n", "\x1b", "\u202e"} and len(message) <= events.EVENT_MESSAGE_MAX_CHARS

    entry = {"attempt": 0, "reason": "Hang", "time": "2026-11-28T11:00:00Z", "path": "", "problems": [FORGED]}
    attempts.write_archived(api, unwatched_namespace, "hostile", entry)
    stored = kubernetes.client.CustomObjectsApi(api).get_namespaced_custom_object(
        names.GROUP, names.VERSION, unwatched_namespace, names.PLURAL, "hostile"
    )
    (problem,) = stored["status"]["archives"][0]["problems"]
    assert problem.startswith("\\n2026-11-28 11:00:00Z CIRCUIT") and "\\x1b[2J\\u202e" in problem


async def test_an_archive_that_fails_unforeseen_is_one_problem_on_the_job_not_a_retry_loop(
    api, unwatched_namespace, monkeypatch
):
    """Whatever goes wrong while keeping a job's evidence (here: analysing what it left raises), the job
    gets a problem and an Event once, and recovery goes on: no retry every 10 s."""
    from rankwatch.operator.config import OperatorConfig
    from rankwatch.operator.diagnosis.ingest.collector import SecretTokens
    from rankwatch.operator.recovery import archive, evidence
    from rankwatch.operator.recovery.reconcile import Recovery

    kubernetes.client.CoreV1Api(api).create_namespaced_secret(
        unwatched_namespace,
        {
            "metadata": {"name": "bucket", "labels": {archive.CREDENTIALS_LABEL: "true"}},  # opted in as credentials
            "stringData": {"accessKeyId": "AKIAEXAMPLE", "secretAccessKey": "example"},
        },
    )
    job = make_job(api, unwatched_namespace, archive={"s3": {"bucket": "traces", "secretRef": {"name": "bucket"}}})
    objects = kubernetes.client.CustomObjectsApi(api)
    failed = {"type": "Failed", "status": "True", "reason": "WorkerFailed", "message": "exit 1",
              "lastTransitionTime": "2026-11-28T11:00:00Z"}  # fmt: skip
    objects.patch_namespaced_custom_object_status(
        names.GROUP, names.VERSION, unwatched_namespace, names.PLURAL, "hostile",
        {"status": {"phase": "Failed", "conditions": [failed]}},
    )  # fmt: skip
    calls = []

    async def collect(*args, **kwargs):
        calls.append(args)
        raise OverflowError("Python int too large to convert to C long")

    monkeypatch.setattr(evidence, "collect", collect)
    monkeypatch.setattr(kubernetes.client.Configuration, "_default", api.configuration)  # as the operator sets it
    recovery = Recovery(api, OperatorConfig(), SecretTokens(api))
    await recovery.reconcile(unwatched_namespace, job["metadata"]["name"])
    await recovery.reconcile(unwatched_namespace, job["metadata"]["name"])  # the next job event
    assert len(calls) == 1
    stored = objects.get_namespaced_custom_object(
        names.GROUP, names.VERSION, unwatched_namespace, names.PLURAL, "hostile"
    )
    (archived,) = stored["status"]["archives"]
    assert archived["path"] == "" and archived["reason"] == "Failed"
    assert archived["problems"] == ["evidence not kept: OverflowError: Python int too large to convert to C long"]
    posted = kubernetes.client.CoreV1Api(api).list_namespaced_event(unwatched_namespace).items
    assert [e.reason for e in posted if e.reason == "EvidenceNotKept"] == ["EvidenceNotKept"]
