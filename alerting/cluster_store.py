"""The alert store in the API server: what survives a failover to the other operator replica.

The SQLite store (``store.py``) lives on one pod's volume; a standby taking over after the leader died
would start with an empty one, page again for every active alert (Alertmanager re-sends them) and lose
the history of the weekly report. This store keeps the same state in ConfigMaps of the operator's
namespace, which every replica reaches:

- ``<name>``: the working state, gzip'd JSON in ``binaryData``: active alerts, the notification log,
  silences, meta (the report's last slot) and the open episodes. Rewritten on each change (a change is
  a batch: one webhook post, one flushed group), conditional on its resourceVersion: a write that
  finds it changed means another replica writes it, and is refused (:class:`StoreError`), never
  merged.
- ``<name>-history-<YYYY-MM-DD>``: the closed episodes (firings) that started in the week beginning
  that Monday (UTC), for the weekly report; old weeks are deleted after the retention.

Compressed, the working state holds thousands of active alerts within the 1 MiB object limit;
beyond it a write fails with a message saying so. A change is made to a copy of the state and
becomes the state only once written: a refused write leaves the store as it was, so one team's
refused alert does not make every later write (another team's alert) fail too.
Blocking (the Kubernetes client); the pipeline's writes are small and rare (per batch, not per alert).
"""

from __future__ import annotations

import base64
import contextlib
import copy
import datetime
import gzip
import json
import threading
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any

import kubernetes
from kubernetes.client.exceptions import ApiException

from rankwatch.alerting.model import Alert, Level, job_of, node_of
from rankwatch.alerting.silences import Silence
from rankwatch.alerting.store import (
    AlertStore,
    Episode,
    NotifyRecord,
    StoreError,
    silence_from_data,
    silence_to_data,
)

if TYPE_CHECKING:
    from rankwatch.alerting.config import StoreConfig

SCHEMA = 1
STATE_KEY = "state.json.gz"
HISTORY_KEY = "episodes.json.gz"
MAX_OBJECT_BYTES = 900 << 10
"""Under the API server's 1 MiB per object, with room for metadata."""
STORE_LABEL = "rankwatch.io/alert-store"
WEEK = 7 * 86400


def _pack(document: Any) -> str:
    return base64.b64encode(gzip.compress(json.dumps(document, separators=(",", ":")).encode(), 6)).decode()


def _unpack(data: str) -> Any:
    return json.loads(gzip.decompress(base64.b64decode(data)))


def week_start(moment: float) -> datetime.date:
    day = datetime.datetime.fromtimestamp(moment, datetime.UTC).date()
    return day - datetime.timedelta(days=day.weekday())


class ClusterAlertStore:
    def __init__(self, kube: kubernetes.client.ApiClient, namespace: str, name: str) -> None:
        self.core = kubernetes.client.CoreV1Api(kube)
        self.namespace, self.name = namespace, name
        self.path = f"ConfigMap {namespace}/{name}"
        self._lock = threading.Lock()
        self._version: str | None = None
        self._state = self._load()

    def close(self) -> None:
        pass

    # -- the working state ------------------------------------------------------------------------

    def _empty(self) -> dict[str, Any]:
        return {"schema": SCHEMA, "alerts": {}, "nlog": [], "silences": {}, "meta": {}, "open": {}}

    def _load(self) -> dict[str, Any]:
        try:
            configmap = self.core.read_namespaced_config_map(self.name, self.namespace)
        except ApiException as error:
            if error.status == 404:
                return self._empty()
            raise StoreError(f"alert store {self.path}: HTTP {error.status} {error.reason}") from None
        self._version = configmap.metadata.resource_version
        try:
            state = _unpack((configmap.binary_data or {})[STATE_KEY])
        except (KeyError, ValueError, OSError) as error:
            raise StoreError(f"alert store {self.path}: unreadable ({error}); delete it to start afresh") from None
        if int(state.get("schema", 0)) > SCHEMA:
            raise StoreError(f"alert store {self.path}: schema {state['schema']} is newer than this rankwatch")
        return {**self._empty(), **state}

    @contextlib.contextmanager
    def _change(self) -> Iterator[dict[str, Any]]:
        """A copy of the working state to change; written when the block ends, and only then the
        state (caller holds the lock). A write refused leaves the state as it was."""
        draft = copy.deepcopy(self._state)
        yield draft
        self._save(draft)
        self._state = draft

    def _save(self, state: dict[str, Any]) -> None:
        """Write ``state`` as the working state (caller holds the lock)."""
        packed = _pack(state)
        if len(packed) > MAX_OBJECT_BYTES:
            raise StoreError(
                f"alert store {self.path}: {len(packed) >> 10} KiB compressed is over the "
                f"{MAX_OBJECT_BYTES >> 10} KiB an object may hold ({len(state['alerts'])} active alerts); not written"
            )
        body = {
            "metadata": {
                "name": self.name,
                "namespace": self.namespace,
                "labels": {STORE_LABEL: self.name, "app.kubernetes.io/managed-by": "rankwatch"},
            },
            "binaryData": {STATE_KEY: packed},
        }
        try:
            if self._version is None:
                result = self.core.create_namespaced_config_map(self.namespace, body)
            else:
                body["metadata"]["resourceVersion"] = self._version
                result = self.core.replace_namespaced_config_map(self.name, self.namespace, body)
        except ApiException as error:
            if error.status == 409:
                raise StoreError(
                    f"alert store {self.path} was changed by someone else (another operator replica leads?); "
                    "not overwriting it"
                ) from None
            raise StoreError(f"alert store {self.path}: HTTP {error.status} {error.reason}") from None
        self._version = result.metadata.resource_version

    # -- alerts -------------------------------------------------------------------------------------

    def save_alerts(self, alerts: Iterable[Alert], now: float) -> None:
        with self._lock, self._change() as state:
            closed: list[list[Any]] = []
            for alert in alerts:
                fp = alert.fingerprint
                state["alerts"][fp] = alert.to_json()
                episode = state["open"].get(fp)
                if alert.resolved(now):
                    if episode is not None:
                        closed.append([*episode[:5], alert.ends_at])
                        del state["open"][fp]
                elif episode is None:
                    scope = job_of(alert) or node_of(alert)
                    state["open"][fp] = [fp, alert.name, scope, alert.level.value, alert.starts_at, None]
                else:
                    episode[3] = alert.level.value
            self._append_history(closed)  # first: a crash before the state write leaves it open, not lost

    def load_alerts(self) -> list[Alert]:
        with self._lock:
            return [Alert.from_json(data) for data in self._state["alerts"].values()]

    def forget_alerts(self, fingerprints: Iterable[str]) -> None:
        with self._lock, self._change() as state:
            for fp in fingerprints:
                state["alerts"].pop(fp, None)

    # -- notification log ---------------------------------------------------------------------------

    def load_notify_log(self) -> dict[tuple[str, str], NotifyRecord]:
        with self._lock:
            return {(g, r): NotifyRecord(g, r, frozenset(f), frozenset(s), t) for g, r, f, s, t in self._state["nlog"]}

    def record_notified(self, records: Iterable[NotifyRecord], retired: Iterable[str] = ()) -> None:
        with self._lock, self._change() as state:
            log = {(g, r): [g, r, f, s, t] for g, r, f, s, t in state["nlog"]}
            for record in records:
                log[(record.group_key, record.receiver)] = [
                    record.group_key, record.receiver, sorted(record.firing), sorted(record.resolved), record.sent_at
                ]  # fmt: skip
            state["nlog"] = list(log.values())
            for fp in retired:
                state["alerts"].pop(fp, None)

    def forget_groups(self, keys: Iterable[tuple[str, str]]) -> None:
        with self._lock, self._change() as state:
            gone = set(keys)
            state["nlog"] = [entry for entry in state["nlog"] if (entry[0], entry[1]) not in gone]

    # -- silences -----------------------------------------------------------------------------------

    def save_silence(self, silence: Silence) -> None:
        with self._lock, self._change() as state:
            state["silences"][silence.id] = silence_to_data(silence)

    def load_silences(self, now: float) -> list[Silence]:
        with self._lock:
            expired = [key for key, data in self._state["silences"].items() if data["endsAt"] <= now]
            if expired:
                with self._change() as state:
                    for key in expired:
                        del state["silences"][key]
            return [silence_from_data(data) for data in self._state["silences"].values()]

    def delete_silence(self, silence_id: str) -> bool:
        with self._lock:
            if silence_id not in self._state["silences"]:
                return False
            with self._change() as state:
                del state["silences"][silence_id]
            return True

    # -- history ------------------------------------------------------------------------------------

    def _history_name(self, week: datetime.date) -> str:
        return f"{self.name}-history-{week.isoformat()}"

    def _read_week(self, week: datetime.date) -> tuple[list[list[Any]], str | None]:
        try:
            configmap = self.core.read_namespaced_config_map(self._history_name(week), self.namespace)
        except ApiException as error:
            if error.status == 404:
                return [], None
            raise StoreError(f"alert store {self.path}: HTTP {error.status} {error.reason}") from None
        return _unpack((configmap.binary_data or {}).get(HISTORY_KEY) or _pack([])), configmap.metadata.resource_version

    def _append_history(self, closed: list[list[Any]]) -> None:
        by_week: dict[datetime.date, list[list[Any]]] = {}
        for episode in closed:
            by_week.setdefault(week_start(episode[4]), []).append(episode)
        for week, added in by_week.items():
            episodes, version = self._read_week(week)
            known = {(e[0], e[4]) for e in episodes}
            episodes += [e for e in added if (e[0], e[4]) not in known]
            body: dict[str, Any] = {
                "metadata": {
                    "name": self._history_name(week),
                    "namespace": self.namespace,
                    "labels": {STORE_LABEL: self.name, "app.kubernetes.io/managed-by": "rankwatch"},
                },
                "binaryData": {HISTORY_KEY: _pack(episodes)},
            }
            try:
                if version is None:
                    self.core.create_namespaced_config_map(self.namespace, body)
                else:
                    body["metadata"]["resourceVersion"] = version
                    self.core.replace_namespaced_config_map(self._history_name(week), self.namespace, body)
            except ApiException as error:
                raise StoreError(f"alert store {self.path}: history of {week}: HTTP {error.status}") from None

    def episodes(self, start: float, end: float) -> list[Episode]:
        """Firings that started in [start, end)."""
        with self._lock:
            rows = [list(e) for e in self._state["open"].values()]
        week = week_start(start)
        while datetime.datetime.combine(week, datetime.time(), datetime.UTC).timestamp() < end:
            rows += self._read_week(week)[0]
            week += datetime.timedelta(days=7)
        return sorted(
            (Episode(fp, name, scope, Level(level), s, e) for fp, name, scope, level, s, e in rows if start <= s < end),
            key=lambda episode: episode.starts_at,
        )

    def prune(self, before: float) -> int:
        """Delete the weeks of history that ended before ``before``; the number of episodes deleted."""
        deleted = 0
        listed = self.core.list_namespaced_config_map(self.namespace, label_selector=f"{STORE_LABEL}={self.name}")
        prefix = f"{self.name}-history-"
        for configmap in listed.items:
            name = configmap.metadata.name
            if not name.startswith(prefix):
                continue
            try:
                week = datetime.date.fromisoformat(name[len(prefix) :])
            except ValueError:
                continue
            if datetime.datetime.combine(week, datetime.time(), datetime.UTC).timestamp() + WEEK < before:
                deleted += len(_unpack((configmap.binary_data or {}).get(HISTORY_KEY) or _pack([])))
                try:
                    self.core.delete_namespaced_config_map(name, self.namespace)
                except ApiException as error:
                    if error.status != 404:
                        raise StoreError(f"alert store {self.path}: deleting {name}: HTTP {error.status}") from None
        return deleted

    # -- meta ---------------------------------------------------------------------------------------

    def get_meta(self, key: str) -> str | None:
        with self._lock:
            return self._state["meta"].get(key)

    def set_meta(self, key: str, value: str) -> None:
        with self._lock, self._change() as state:
            state["meta"][key] = value


def open_store(config: StoreConfig, kube: Any = None, namespace: str = "") -> AlertStore | ClusterAlertStore:
    """The store ``config`` names: a SQLite file (``path``), or ConfigMaps in ``namespace`` through
    ``kube`` (``configMap``), which every operator replica reaches."""
    if config.path:
        return AlertStore(config.path)
    if kube is None or not namespace:
        raise StoreError(f"store.configMap {config.config_map!r} is read through the API: give a client and namespace")
    return ClusterAlertStore(kube, namespace, config.config_map)
