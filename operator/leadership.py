"""One active replica: a coordination.k8s.io Lease, held by the leader and renewed every second.

The algorithm is client-go's leader election: a replica may take the Lease when it has no holder or
when its record has not changed for ``leaseDurationSeconds`` as this replica observed it (its own
clock, never a comparison of two machines' clocks); writes are conditional on the Lease's
resourceVersion, so of two replicas trying at once one wins. The leader renews every
``retry_seconds``; if it cannot for ``renew_deadline_seconds`` it stops acting (before its Lease can
expire and a standby take over). On a clean shutdown it gives the Lease up at once, so the standby
does not wait for it to expire.
"""

from __future__ import annotations

import asyncio
import datetime
import logging
import time
from dataclasses import dataclass

import kubernetes
from kubernetes.client.exceptions import ApiException

from rankwatch.operator.config import LeaderElection

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Record:
    holder: str
    renew_time: str
    transitions: int
    duration_s: float


def _micro_time(moment: datetime.datetime | None = None) -> str:
    moment = moment or datetime.datetime.now(datetime.UTC)
    return moment.strftime("%Y-%m-%dT%H:%M:%S.%fZ")


class Lease:
    def __init__(self, kube: kubernetes.client.ApiClient, settings: LeaderElection) -> None:
        self.settings = settings
        self.api = kubernetes.client.CoordinationV1Api(kube)
        self._observed: _Record | None = None
        self._observed_at = 0.0
        self._renewed_at: float | None = None
        self.holder = ""
        """Who holds the Lease as last seen (for the readiness probe's message)."""

    @property
    def name(self) -> str:
        return f"Lease {self.settings.lease_namespace}/{self.settings.lease_name}"

    def held(self) -> bool:
        """True while this replica leads: it renewed within the renew deadline."""
        return (
            self._renewed_at is not None and time.monotonic() - self._renewed_at < self.settings.renew_deadline_seconds
        )

    async def acquire(self) -> None:
        """Return once this replica holds the Lease."""
        logged = False
        while not await self._try():
            if not logged:
                log.info("standby: %s is held by %s; waiting", self.name, self.holder or "nobody")
                logged = True
            await asyncio.sleep(self.settings.retry_seconds)
        log.warning("leading: acquired %s as %s", self.name, self.settings.identity)

    async def hold(self) -> None:
        """Renew until the renew deadline passes without a successful renewal; then return (lost)."""
        while True:
            await asyncio.sleep(self.settings.retry_seconds)
            if await self._try():
                continue
            if not self.held():
                log.error("lost %s (held by %s now, or not renewable for %.0f s); stopping", self.name,
                          self.holder or "nobody", self.settings.renew_deadline_seconds)  # fmt: skip
                self._renewed_at = None
                return

    async def release(self) -> None:
        """Give the Lease up (a clean shutdown): the standby takes it at its next look."""
        if self._renewed_at is None:
            return
        self._renewed_at = None
        try:
            await asyncio.to_thread(self._release)
            log.info("released %s", self.name)
        except Exception as error:  # it expires on its own
            log.warning("could not release %s (%s); it expires in %.0f s", self.name, error,
                        self.settings.lease_seconds)  # fmt: skip

    async def _try(self) -> bool:
        try:
            acquired = await asyncio.to_thread(self._try_acquire_or_renew)
        except Exception as error:  # API trouble: as if not renewed; the deadline decides
            log.warning("%s: %s", self.name, error)
            return False
        if acquired:
            self._renewed_at = time.monotonic()
        return acquired

    def _try_acquire_or_renew(self) -> bool:
        settings = self.settings
        namespace, name, me = settings.lease_namespace, settings.lease_name, settings.identity
        now = _micro_time()
        timeout = max(1.0, settings.retry_seconds)
        try:
            lease = self.api.read_namespaced_lease(name, namespace, _request_timeout=timeout)
        except ApiException as error:
            if error.status != 404:
                raise
            body = {
                "metadata": {"name": name, "namespace": namespace},
                "spec": {
                    "holderIdentity": me,
                    "leaseDurationSeconds": int(settings.lease_seconds),
                    "acquireTime": now,
                    "renewTime": now,
                    "leaseTransitions": 0,
                },
            }
            try:
                self.api.create_namespaced_lease(namespace, body, _request_timeout=timeout)
            except ApiException as conflict:
                if conflict.status == 409:
                    return False
                raise
            self.holder = me
            return True
        spec = lease.spec
        record = _Record(
            spec.holder_identity or "",
            str(spec.renew_time),
            spec.lease_transitions or 0,
            float(spec.lease_duration_seconds or settings.lease_seconds),
        )
        if record != self._observed:
            self._observed, self._observed_at = record, time.monotonic()
        self.holder = record.holder
        if record.holder and record.holder != me and time.monotonic() < self._observed_at + record.duration_s:
            return False
        ours = record.holder == me
        body = {
            "metadata": {"name": name, "namespace": namespace, "resourceVersion": lease.metadata.resource_version},
            "spec": {
                "holderIdentity": me,
                "leaseDurationSeconds": int(settings.lease_seconds),
                "acquireTime": _micro_time(spec.acquire_time) if ours and spec.acquire_time else now,
                "renewTime": now,
                "leaseTransitions": record.transitions + (0 if ours else 1),
            },
        }
        try:
            self.api.replace_namespaced_lease(name, namespace, body, _request_timeout=timeout)
        except ApiException as error:
            if error.status == 409:  # someone else wrote first
                return False
            raise
        self.holder = me
        return True

    def _release(self) -> None:
        settings = self.settings
        lease = self.api.read_namespaced_lease(settings.lease_name, settings.lease_namespace)
        if lease.spec.holder_identity != settings.identity:
            return
        now = _micro_time()
        body = {
            "metadata": {
                "name": settings.lease_name,
                "namespace": settings.lease_namespace,
                "resourceVersion": lease.metadata.resource_version,
            },
            "spec": {
                "holderIdentity": "",
                "leaseDurationSeconds": 1,
                "acquireTime": now,
                "renewTime": now,
                "leaseTransitions": lease.spec.lease_transitions or 0,
            },
        }
        self.api.replace_namespaced_lease(settings.lease_name, settings.lease_namespace, body)
