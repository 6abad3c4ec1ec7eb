"""A pod is a TrainingJob's through its controller reference, never through its labels."""

from __future__ import annotations

import kubernetes

from rankwatch.operator import ownership

OWNER = {"apiVersion": "rankwatch.io/v1alpha1", "kind": "TrainingJob", "name": "llama", "uid": "u-1"} | {
    "controller": True
}


def test_the_jobs_controller_reference_makes_the_pod_its_own_in_both_spellings():
    metadata = {"name": "llama-worker-0", "ownerReferences": [OWNER]}
    assert ownership.is_owned_by(metadata, "u-1")
    reference = kubernetes.client.V1OwnerReference(
        api_version="rankwatch.io/v1alpha1", kind="TrainingJob", name="llama", uid="u-1", controller=True
    )
    model = kubernetes.client.V1ObjectMeta(name="llama-worker-0", owner_references=[reference])
    assert ownership.is_owned_by(model, "u-1") and ownership.controller_uid(model) == "u-1"


def test_labels_alone_another_uid_a_non_controller_or_a_lookalike_kind_own_nothing():
    labelled_only = {"name": "x", "labels": {"rankwatch.io/job-name": "llama"}}
    assert not ownership.is_owned_by(labelled_only, "u-1")
    assert not ownership.is_owned_by({"ownerReferences": [{**OWNER, "uid": "u-2"}]}, "u-1")
    assert not ownership.is_owned_by({"ownerReferences": [{**OWNER, "controller": False}]}, "u-1")
    assert not ownership.is_owned_by({"ownerReferences": [{**OWNER, "apiVersion": "evil.io/v1"}]}, "u-1")
    assert not ownership.is_owned_by({"ownerReferences": [OWNER]}, "")
