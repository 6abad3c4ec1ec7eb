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


def make_job(api, namespace: str) -> dict:
    manifest = {
        "apiVersion": names.API_VERSION,
        "kind": names.KIND,
        "metadata": {"name": "hostile"},
        "spec": {
            "replicas": 1,
            "nprocPerNode": 1,
            "template": {"spec": {"containers": [{"name": "t", "image": "t:1"}]}},
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
