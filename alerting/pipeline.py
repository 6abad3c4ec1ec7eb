"""The alert pipeline: alerts in, notifications out, inside the operator's event loop.

    submit(alerts) ─► store (committed) ─► route ─► group ─(group_wait / group_interval)─► flush:
        silenced? inhibited? ─► new, resolved or repeat due? ─► storm gate ─► receiver (retries)
        ─► notification log (committed)

Each step is the Alertmanager step of the same name; the notification log is what makes
duplicates, repeats and restarts come out right (see ``store.py``). One task evaluates all groups
every ``evaluation_interval``; deliveries run as their own tasks so a slow receiver holds up only
its own groups.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import aiohttp

from rankwatch.alerting.cluster_store import open_store
from rankwatch.alerting.config import AlertingConfig
from rankwatch.alerting.delivery import REASONS, DeliveryError, Receiver, deliver
from rankwatch.alerting.inhibition import inhibited_by
from rankwatch.alerting.matchers import Matcher, matches_all
from rankwatch.alerting.messages import Message, Notification, StormSummary, TestMessage, WeeklyReport
from rankwatch.alerting.metrics import AlertMetrics
from rankwatch.alerting.model import Alert, Level
from rankwatch.alerting.receivers import build_receivers
from rankwatch.alerting.report import last_slot, weekly_report
from rankwatch.alerting.routing import GroupKey, group_keys
from rankwatch.alerting.silences import Silence, silenced_by
from rankwatch.alerting.store import AlertStore, NotifyRecord
from rankwatch.alerting.storm import StormGate

log = logging.getLogger(__name__)

REPORT_SLOT = "report_slot"
REPORT_RETRY = 300.0


@dataclass
class _Group:
    key: GroupKey
    next_flush: float
    alerts: dict[str, Alert] = field(default_factory=dict)
    sending: bool = False

    @property
    def id(self) -> str:
        return self.key.key


class AlertPipeline:
    """Give it alerts; it notifies the configured receivers. ``start()`` before use, ``stop()`` after."""

    def __init__(
        self,
        config: AlertingConfig,
        *,
        store: AlertStore | None = None,
        receivers: Mapping[str, Receiver] | None = None,
        metrics: AlertMetrics | None = None,
        clock: Any = time.time,
    ) -> None:
        self.config = config
        self.receivers = dict(receivers) if receivers is not None else build_receivers(config)
        self.metrics = metrics or AlertMetrics.uncounted()
        self._clock = clock
        self._store = store
        self._owns_store = store is None
        self._alerts: dict[str, Alert] = {}
        self._memberships: dict[str, set[str]] = {}
        self._groups: dict[str, _Group] = {}
        self._nlog: dict[tuple[str, str], NotifyRecord] = {}
        self._silences: list[Silence] = []
        self._muted: dict[str, str] = {}
        self._storm = {name: StormGate(name, config.storm) for name in self.receivers}
        self._limits = {name: asyncio.Semaphore(config.delivery.concurrency) for name in self.receivers}
        self._paused: dict[str, tuple[float, str]] = {}
        self.last_error: dict[str, str] = {}
        """Receiver name -> the last delivery error (for status and the CLI)."""
        self._tasks: set[asyncio.Task[Any]] = set()
        self._loop_task: asyncio.Task[None] | None = None
        self._session: aiohttp.ClientSession | None = None
        self._report_busy = False
        self._report_retry_at = 0.0

    # -- lifecycle ------------------------------------------------------------------------------

    @property
    def store(self) -> AlertStore:
        if self._store is None:
            raise RuntimeError("AlertPipeline: call start() first")
        return self._store

    async def start(self, evaluate: bool = True) -> None:
        """Open the store, rebuild groups from the alerts it holds, start evaluating.

        ``evaluate=False`` only opens the store and an HTTP session: on-demand reports and tests
        (the CLI beside a running operator) without notifying anything of the operator's alerts.
        """
        if self._store is None:
            self._store = open_store(self.config.store)
        self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=self.config.delivery.timeout))
        if not evaluate:
            return
        self.metrics.start_at_zero(self.receivers, REASONS)
        now = self._clock()
        self._nlog = self.store.load_notify_log()
        self._silences = self._config_silences() + self.store.load_silences(now)
        restored = self.store.load_alerts()
        for alert in restored:
            self._admit(alert, now)
        stale = [key for key in self._nlog if key[0] not in self._groups]
        for key in stale:
            del self._nlog[key]
        self.store.forget_groups(stale)
        self.store.prune(now - self.config.store.retention)
        self._loop_task = asyncio.create_task(self._run(), name="rankwatch-alerting")
        self.metrics.ready.set(1)
        log.info(
            "alerting started: %d receivers, %d active alerts restored, store %s",
            len(self.receivers),
            len(restored),
            self.store.path,
        )

    async def stop(self, grace: float = 5.0) -> None:
        """Stop evaluating; give deliveries in flight ``grace`` seconds, then cancel them (they resend later)."""
        if self._loop_task is not None:
            self._loop_task.cancel()
            await asyncio.gather(self._loop_task, return_exceptions=True)
            self._loop_task = None
        if self._tasks:
            _, pending = await asyncio.wait(list(self._tasks), timeout=grace)
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
        if self._session is not None:
            await self._session.close()
            self._session = None
        if self._owns_store and self._store is not None:
            self._store.close()
            self._store = None

    async def __aenter__(self) -> AlertPipeline:
        await self.start()
        return self

    async def __aexit__(self, *_: object) -> None:
        await self.stop()

    async def wait_idle(self, timeout: float = 30.0) -> None:
        """Until no delivery is in flight (tests, benchmarks)."""
        deadline = time.monotonic() + timeout
        while self._tasks:
            await asyncio.wait(list(self._tasks), timeout=max(0.0, deadline - time.monotonic()))
            if time.monotonic() >= deadline:
                raise TimeoutError(f"{len(self._tasks)} deliveries still in flight")

    # -- alerts in ------------------------------------------------------------------------------

    async def submit(self, alerts: Iterable[Alert]) -> None:
        """Take alerts (firing, or resolved with ``ends_at`` set). Stored before this returns."""
        now = self._clock()
        batch: list[Alert] = []
        for alert in alerts:
            self.metrics.received.labels(alert.level.value, alert.source).inc()
            old = self._alerts.get(alert.fingerprint)
            if old is not None and not old.resolved(now):
                if not alert.resolved(now):
                    self.metrics.suppressed.labels(alert.level.value, "duplicate").inc()
                alert = replace(alert, starts_at=min(old.starts_at, alert.starts_at))
            elif old is None and alert.resolved(now):
                continue  # never seen firing (or already told resolved): nothing to say
            batch.append(alert)
        if not batch:
            return
        self.store.save_alerts(batch, now)
        for alert in batch:
            self._admit(alert, now)

    async def resolve(self, fingerprints: Iterable[str] = (), *, labels: Mapping[str, str] | None = None) -> int:
        """Resolve active alerts by fingerprint, or all whose labels include ``labels``; returns how many."""
        now = self._clock()
        chosen = {fp for fp in fingerprints if fp in self._alerts}
        if labels:
            chosen |= {fp for fp, a in self._alerts.items() if all(a.labels.get(k) == v for k, v in labels.items())}
        resolved = [self._alerts[fp].resolve(now) for fp in chosen if not self._alerts[fp].resolved(now)]
        await self.submit(resolved)
        return len(resolved)

    def active_alerts(self) -> list[Alert]:
        return list(self._alerts.values())

    def _admit(self, alert: Alert, now: float) -> None:
        fp = alert.fingerprint
        self._alerts[fp] = alert
        for key in group_keys(self.config.route, alert):
            group = self._groups.get(key.key)
            if group is None:
                # From when we first saw it, not its startsAt: a sender's clock may be ahead of ours.
                group = self._groups[key.key] = _Group(key, next_flush=now + key.route.group_wait)
                if (key.key, key.receiver) in self._nlog:
                    group.next_flush = now  # known group after a restart: compare with the log at once
            group.alerts[fp] = alert
            self._memberships.setdefault(fp, set()).add(key.key)

    # -- silences -------------------------------------------------------------------------------

    def add_silence(
        self,
        matchers: Iterable[str | Matcher],
        ends_at: float,
        created_by: str = "",
        comment: str = "",
        starts_at: float | None = None,
    ) -> Silence:
        """A silence from ``starts_at`` (default now; a later start mutes nothing until then) to
        ``ends_at``; stored, so it outlives a restart."""
        parsed = [m if isinstance(m, Matcher) else Matcher.parse(m) for m in matchers]
        silence = Silence.new(parsed, self._clock() if starts_at is None else starts_at, ends_at, created_by, comment)
        self.store.save_silence(silence)
        self._silences.append(silence)
        return silence

    def expire_silence(self, silence_id: str) -> bool:
        before = len(self._silences)
        self._silences = [s for s in self._silences if s.id != silence_id]
        return self.store.delete_silence(silence_id) or len(self._silences) < before

    def silences(self) -> list[Silence]:
        now = self._clock()
        return [s for s in self._silences if s.ends_at > now]

    def _config_silences(self) -> list[Silence]:
        return [
            Silence(s.matchers, s.starts_at, s.ends_at, s.created_by, s.comment, f"config-{i}")
            for i, s in enumerate(self.config.silences)
        ]

    # -- evaluation -----------------------------------------------------------------------------

    async def _run(self) -> None:
        while True:
            try:
                self.evaluate()
            except Exception:  # one bad evaluation must not end alerting for the operator's lifetime
                log.exception("alert evaluation failed")
            await asyncio.sleep(self.config.evaluation_interval)

    def evaluate(self, now: float | None = None) -> None:
        """Flush due groups, send due storm summaries and the weekly report. Called by the loop."""
        now = self._clock() if now is None else now
        due = [g for g in self._groups.values() if not g.sending and g.next_flush <= now]
        if due:
            self._silences = [s for s in self._silences if s.ends_at > now]
            sources = self._inhibition_sources(now)
            for group in due:
                self._flush(group, now, sources)
        for gate in self._storm.values():
            summary = gate.summary_due(now)
            if summary is not None:
                self._spawn(self._send_summary(summary))
        self._schedule_report(now)

    def _inhibition_sources(self, now: float) -> list[Alert]:
        rules = self.config.inhibit_rules
        if not rules:
            return []
        return [
            a
            for a in self._alerts.values()
            if not a.resolved(now) and any(matches_all(r.source_matchers, a.match_labels()) for r in rules)
        ]

    def _mute_reason(self, alert: Alert, now: float, sources: list[Alert]) -> str | None:
        if silenced_by(alert, self._silences, now) is not None:
            reason = "silenced"
        elif sources and inhibited_by(alert, self.config.inhibit_rules, sources, now) is not None:
            reason = "inhibited"
        else:
            self._muted.pop(alert.fingerprint, None)
            return None
        if self._muted.get(alert.fingerprint) != reason:  # count each alert once per reason, not per flush
            self._muted[alert.fingerprint] = reason
            self.metrics.suppressed.labels(alert.level.value, reason).inc()
        return reason

    def _flush(self, group: _Group, now: float, sources: list[Alert]) -> None:
        route = group.key.route
        group.next_flush = now + route.group_interval
        receiver = group.key.receiver
        record = self._nlog.get((group.id, receiver))
        told = record.firing if record else frozenset()
        firing, resolved = [], []
        for alert in group.alerts.values():
            if alert.resolved(now):
                resolved.append(alert)
            elif self._mute_reason(alert, now, sources) is None:
                firing.append(alert)
        send_resolved = self.config.receivers[receiver].send_resolved
        to_tell = [a for a in resolved if a.fingerprint in told] if send_resolved else []
        telling = {a.fingerprint for a in to_tell}
        untold = [a for a in resolved if a.fingerprint not in telling]
        if untold:
            self._retire(group, untold, record, now)
        new = {a.fingerprint for a in firing} - told
        repeat = bool(firing) and record is not None and now - record.sent_at >= route.repeat_interval
        if not (new or to_tell or repeat):
            return
        notification = Notification(
            receiver=receiver,
            group_key=group.id,
            group_labels=dict(group.key.labels),
            firing=tuple(sorted(firing, key=lambda a: (a.level.rank, a.starts_at))),
            resolved=tuple(to_tell),
            repeat=not new and not to_tell,
        )
        group.sending = True
        self._spawn(self._notify(group, notification))

    async def _notify(self, group: _Group, notification: Notification) -> None:
        delivered = False
        try:
            gate = self._storm[notification.receiver]
            if gate.is_held(group.id):
                gate.held[group.id] = notification  # newer content for the summary
                return
            if gate.is_summarised(group.id):
                return
            if not gate.admit(notification, self._clock()):
                for alert in notification.alerts:
                    self.metrics.suppressed.labels(alert.level.value, "storm").inc()
                return
            delivered = await self._deliver(notification.receiver, notification, notification.alerts)
        finally:
            group.sending = False
        if delivered:
            self._record([notification])

    async def _send_summary(self, summary: StormSummary) -> None:
        alerts = tuple(a for n in summary.notifications for a in n.alerts)
        try:
            if await self._deliver(summary.receiver, summary, alerts):
                self._record(summary.notifications)
        finally:
            self._storm[summary.receiver].summary_sent(summary)

    def _record(self, notifications: Iterable[Notification]) -> None:
        """The receiver has them: log what it was told, retire the resolved alerts it was told about."""
        now = self._clock()
        records, retired = [], []
        for notification in notifications:
            group = self._groups.get(notification.group_key)
            if group is None:
                continue  # every alert of it was retired meanwhile (a storm summary can be that late)
            record = NotifyRecord(
                notification.group_key,
                notification.receiver,
                # Only what the group still holds: a fingerprint logged for an alert retired meanwhile
                # would make the same alert firing again look already told.
                frozenset(a.fingerprint for a in notification.firing if a.fingerprint in group.alerts),
                frozenset(a.fingerprint for a in notification.resolved),
                now,
            )
            self._nlog[(record.group_key, record.receiver)] = record
            records.append(record)
            retired += self._drop(group, [a for a in notification.resolved if group.alerts.get(a.fingerprint) == a])
        self.store.record_notified(records, retired)
        self._forget_empty_groups(notification.group_key for notification in notifications)

    def _retire(self, group: _Group, alerts: list[Alert], record: NotifyRecord | None, now: float) -> None:
        """Resolved alerts nobody needs to hear about: drop them; the log forgets them too."""
        retired = self._drop(group, alerts)
        records = []
        gone = {a.fingerprint for a in alerts}
        if record is not None and record.firing & gone:
            record = replace(record, firing=record.firing - gone)
            self._nlog[(record.group_key, record.receiver)] = record
            records.append(record)
        self.store.record_notified(records, retired)
        self._forget_empty_groups([group.id])

    def _drop(self, group: _Group, alerts: list[Alert]) -> list[str]:
        """Remove alerts from a group; returns the fingerprints no group holds any more."""
        gone = []
        for alert in alerts:
            fp = alert.fingerprint
            group.alerts.pop(fp, None)
            holders = self._memberships.get(fp, set())
            holders.discard(group.id)
            if not holders:
                self._memberships.pop(fp, None)
                self._alerts.pop(fp, None)
                self._muted.pop(fp, None)
                gone.append(fp)
        return gone

    def _forget_empty_groups(self, keys: Iterable[str]) -> None:
        empty = []
        for key in set(keys):
            group = self._groups.get(key)
            if group is not None and not group.alerts and not group.sending:
                del self._groups[key]
                empty.append((key, group.key.receiver))
                self._nlog.pop((key, group.key.receiver), None)
        if empty:
            self.store.forget_groups(empty)

    # -- delivery -------------------------------------------------------------------------------

    async def _deliver(self, name: str, message: Message, alerts: tuple[Alert, ...]) -> bool:
        level = message.level.value
        async with self._limits[name]:
            paused = self._paused.get(name)  # checked after the wait: a request before us may have paused it
            if paused is not None and paused[0] > self._clock():
                for alert in alerts:
                    self.metrics.failed.labels(alert.level.value, name, "paused").inc()
                log.debug("receiver %s paused until its config is fixed: %s", name, paused[1])
                return False
            try:
                await deliver(self.receivers[name], message, self._require_session(), self.config.delivery)
            except DeliveryError as error:
                for alert in alerts or (None,):
                    self.metrics.failed.labels(alert.level.value if alert else level, name, error.reason).inc()
                self.last_error[name] = str(error)
                if error.config_problem:
                    until = self._clock() + self.config.delivery.pause_after_config_error
                    self._paused[name] = (until, str(error))
                    log.error("%s (receiver paused for %.0fs)", error, self.config.delivery.pause_after_config_error)
                else:
                    log.error("%s", error)
                return False
        for alert in alerts:
            self.metrics.sent.labels(alert.level.value, name).inc()
        self._paused.pop(name, None)
        self.last_error.pop(name, None)
        return True

    def _require_session(self) -> aiohttp.ClientSession:
        if self._session is None:
            raise RuntimeError("AlertPipeline: call start() first")
        return self._session

    def _spawn(self, coroutine: Any) -> None:
        task = asyncio.get_running_loop().create_task(coroutine)
        self._tasks.add(task)
        task.add_done_callback(self._task_done)

    def _task_done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("alert delivery task failed", exc_info=task.exception())

    # -- report and test ------------------------------------------------------------------------

    def _schedule_report(self, now: float) -> None:
        receiver = self.config.report.receiver
        if receiver is None or self._report_busy or now < self._report_retry_at:
            return
        slot = last_slot(self.config.report, now)
        sent = self.store.get_meta(REPORT_SLOT)
        if sent is None:  # first start: begin with the next slot, not a report of the past
            self.store.set_meta(REPORT_SLOT, repr(slot))
        elif slot > float(sent):
            self._report_busy = True
            self._spawn(self._scheduled_report(receiver, slot))

    async def _scheduled_report(self, receiver: str, slot: float) -> None:
        try:
            report = weekly_report(self.store, receiver, slot, self.config.report.top)
            if await self._deliver(receiver, report, ()):
                self.store.set_meta(REPORT_SLOT, repr(slot))
            else:
                self._report_retry_at = self._clock() + REPORT_RETRY
        finally:
            self._report_busy = False

    def build_report(self, receiver: str | None = None, end: float | None = None) -> WeeklyReport:
        receiver = receiver or self.config.report.receiver
        if receiver is None or receiver not in self.receivers:
            raise ValueError(f"no report receiver {receiver!r}: set report.receiver or name one")
        return weekly_report(self.store, receiver, self._clock() if end is None else end, self.config.report.top)

    async def send_report(self, receiver: str | None = None, end: float | None = None) -> WeeklyReport:
        """Build and send the report now (``rankwatch alerts report``); raises ``DeliveryError``."""
        report = self.build_report(receiver, end)
        await self._send_now(report.receiver, report)
        return report

    async def send_test(self, receiver: str, level: Level = Level.P3) -> TestMessage:
        """A test card (a call, for a phone receiver) now, whatever the routes; raises ``DeliveryError``."""
        message = TestMessage(receiver, level, self._clock())
        await self._send_now(receiver, message)
        return message

    async def _send_now(self, name: str, message: Message) -> None:
        if name not in self.receivers:
            raise ValueError(f"no receiver named {name!r} (defined: {', '.join(self.receivers)})")
        async with self._limits[name]:
            await deliver(self.receivers[name], message, self._require_session(), self.config.delivery)
        self._paused.pop(name, None)  # it works again: resume notifications
