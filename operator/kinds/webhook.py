"""The mutating admission webhook for pods: injects opted-in pods of other kinds (``injection.py``).

It must never stand between a user and a training job: every problem (a pod it cannot inject, the
API server refusing its token Secret, a bug) lets the pod through unchanged or with the reason in an
annotation, and the MutatingWebhookConfiguration (Helm chart) says ``failurePolicy: Ignore``, so an
operator that is down or slow does not keep pods from starting either. Pods that start without the
injection are reported on their group (``unwatched.py``).

kopf serves it (``settings.admission.server``) on the replica that leads, the only one ready, so the
webhook's Service routes there; the chart owns the configuration (``settings.admission.managed`` stays
unset: kopf would write neither the namespaceSelector nor ``reinvocationPolicy``).
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import kopf

from rankwatch.operator import api
from rankwatch.operator.config import WebhookSettings
from rankwatch.operator.kinds import adapter, injection, trainjob
from rankwatch.operator.spec import InvalidSpec

log = logging.getLogger(__name__)

WEBHOOK_ID = "inject-pods"
"""The handler's id, which is also the URL path the configuration names (``/inject-pods``)."""


class GroupsWithToken:
    """Groups (by uid) whose token Secret this process has seen made: their other pods are admitted
    without an API call (a 1,000-pod Job's pods come in bursts, each waiting for its admission)."""

    def __init__(self, size: int = 10_000) -> None:
        self.size = size
        self._uids: OrderedDict[str, None] = OrderedDict()

    def __contains__(self, uid: str) -> bool:
        return uid in self._uids

    def add(self, uid: str) -> None:
        self._uids[uid] = None
        self._uids.move_to_end(uid)
        while len(self._uids) > self.size:
            self._uids.popitem(last=False)


class TrainJobOfJobSet:
    """JobSet uid -> the uid of the TrainJob controlling it ("" for none), of the JobSets whose pods this
    process admitted: a JobSet's owner never changes, and its pods come in bursts."""

    def __init__(self, size: int = 10_000) -> None:
        self.size = size
        self._owners: OrderedDict[str, str] = OrderedDict()

    def __contains__(self, jobset_uid: str) -> bool:
        return jobset_uid in self._owners

    def get(self, jobset_uid: str) -> str:
        return self._owners.get(jobset_uid, "")

    def add(self, jobset_uid: str, trainjob_uid: str | None) -> None:
        self._owners[jobset_uid] = trainjob_uid or ""
        self._owners.move_to_end(jobset_uid)
        while len(self._owners) > self.size:
            self._owners.popitem(last=False)


def admission_server(settings: WebhookSettings) -> Any:
    """What kopf serves admission requests with: an HTTPS server when the webhook is on; else a server
    that serves nothing (kopf requires one once an admission handler is registered)."""
    if settings.listen is None or settings.cert_dir is None:
        return _no_server
    host, port = settings.listen
    directory = Path(settings.cert_dir)
    return kopf.WebhookServer(
        addr=host, port=port, certfile=directory / "tls.crt", pkeyfile=directory / "tls.key", file_check_interval=30
    )


async def _no_server(_: Any) -> AsyncIterator[Any]:
    await asyncio.Event().wait()
    yield  # never reached: makes this an async generator, as kopf expects of a server


@kopf.on.mutate("v1", "pods", id=WEBHOOK_ID, operations=["CREATE"], side_effects=True, ignore_failures=True)
async def inject_pod(body: kopf.Body, patch: kopf.Patch, dryrun: bool, memo: kopf.Memo, **_: Any) -> None:
    """Add the injection to an opted-in pod, or say on it why not; never refuses a pod."""
    pod = dict(body)
    try:
        decision: injection.Injection | injection.NotInjected
        try:
            pod = await _with_trainjob_uid(memo, pod)
        except Exception as error:
            decision = injection.NotInjected(f"could not read the JobSet this pod belongs to ({error})", True)
        else:
            decision = injection.plan(pod)
        if isinstance(decision, injection.Injection):
            try:
                changed = injection.injected_pod(pod, decision, memo.config.pods)
            except InvalidSpec as error:
                decision = injection.NotInjected(str(error), True)
            else:
                if not dryrun:
                    await _ensure_token(memo, decision)
                patch.fns.append(lambda admitted: admitted.update(spec=changed["spec"]))
                patch.metadata.annotations[api.TRACING_ANNOTATION] = injection.ENABLED
                patch.metadata.labels[api.TRACED_LABEL] = "true"
                owner_uid = (pod["metadata"].get("annotations") or {}).get(trainjob.TRAINJOB_UID_ANNOTATION)
                patch.metadata.annotations[trainjob.TRAINJOB_UID_ANNOTATION] = owner_uid  # None: a pod's own, removed
                return
        if decision.asked:
            log.warning("pod %s/%s not injected: %s", pod["metadata"].get("namespace"), _pod_name(pod), decision.reason)
            patch.metadata.annotations[api.NOT_INJECTED_ANNOTATION] = decision.reason[:1000]
    except Exception:  # a bug must not refuse the pod: let it through, unwatched (and so reported)
        log.exception(
            "pod %s/%s: injection failed; admitted unchanged", pod["metadata"].get("namespace"), _pod_name(pod)
        )
        patch.clear()


async def _with_trainjob_uid(memo: kopf.Memo, pod: dict[str, Any]) -> dict[str, Any]:
    """``pod`` with ``rankwatch.io/trainjob-uid`` as it is: the uid of the TrainJob controlling the JobSet
    the pod's labels name (by name and uid), or absent, whatever the pod's creator wrote there. Only for an
    opted-in pod of a JobSet: one read per JobSet, remembered under the uid the JobSet really has (a pod
    naming a uid that is not its JobSet's teaches nothing), none for other pods."""
    metadata = pod["metadata"]
    labels = metadata.get("labels") or {}
    name, jobset_uid = labels.get(trainjob.jobset.NAME_LABEL), labels.get(trainjob.jobset.UID_LABEL)
    if not injection.opted_in(pod) or injection.is_injected(pod) or not name or not jobset_uid:
        return trainjob.marked(pod, None)
    # The operator's, made at its start: kopf hands each call a copy of the memo, so one made here would not last.
    owners: TrainJobOfJobSet = memo.get("trainjob_of_jobset") or TrainJobOfJobSet()
    if jobset_uid not in owners:
        found = await asyncio.to_thread(trainjob.jobset_owner, memo.kube, metadata.get("namespace", ""), name)
        if found is not None:
            owners.add(*found)
    return trainjob.marked(pod, owners.get(jobset_uid))


async def _ensure_token(memo: kopf.Memo, decision: injection.Injection) -> None:
    """The group's token Secret, made by its first pod, once its owner is known to exist with that uid (a
    pod's owner references are whatever its creator wrote). If the API server refuses now, the pod still
    starts (the Secret volume is optional) and its sidecar ships once a later pod has made it."""
    group = decision.group
    known: GroupsWithToken | None = memo.get("groups_with_token")
    if known is not None and group.uid in known:
        return
    try:
        if await asyncio.to_thread(adapter.read_owner, memo.kube, group) is None:
            log.warning(
                "%s (uid %s), named by a pod's owner reference, does not exist: no token Secret", group, group.uid
            )
            return
        made = await asyncio.to_thread(adapter.ensure_token_secret, memo.kube, decision.adapter, group)
        if known is not None:
            known.add(group.uid)
    except Exception as error:
        log.warning("%s: token Secret not made now (%s); its sidecars wait for it", decision.group, error)
        return
    if made:
        log.info("%s: made token Secret %s", decision.group, decision.adapter.token_secret_name(decision.group.name))


def _pod_name(pod: dict[str, Any]) -> str:
    metadata = pod["metadata"]
    return metadata.get("name") or f"{metadata.get('generateName', '')}*"
