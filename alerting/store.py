"""Alerting state on disk: active alerts, what was notified to whom, silences, history for the report.

Why SQLite on a volume rather than a ConfigMap: the state changes with every alert and every
notification (hundreds of writes in a storm); a ConfigMap write is an API round trip each, is
capped at 1 MiB, and rewrites the whole object, so keeping a week of history for the report would
not fit and a storm would hammer the API server. One SQLite file on the operator's volume takes a
batch of alerts in one transaction in well under a millisecond per alert, keeps months of history,
and survives a process restart (WAL journal: a committed transaction is never lost when the
process dies; ``synchronous=NORMAL`` may lose the last ones only on power loss of the node).

What makes a restart neither lose nor repeat pages: an alert is committed before ``submit``
returns (and before the Alertmanager webhook answers 200), and the notification log records what
each receiver was told, committed right after the receiver accepted it. After a restart, alerts
are regrouped from the table and compared with the log: unsent ones go out, sent ones do not.
(A crash in the instant between Feishu's answer and our commit repeats that one message: at least
once, never lost.) The file is one pod's: for an operator with a standby, ``cluster_store.py`` keeps
the same state in the API server (``store.configMap``, the chart's default), so a failover neither
loses nor repeats a page.
"""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rankwatch.alerting.matchers import Matcher
from rankwatch.alerting.model import Alert, Level, job_of, node_of
from rankwatch.alerting.silences import Silence

SCHEMA = 1

_TABLES = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS alerts (fingerprint TEXT PRIMARY KEY, alert TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS nlog (
    group_key TEXT NOT NULL, receiver TEXT NOT NULL, firing TEXT NOT NULL, resolved TEXT NOT NULL,
    sent_at REAL NOT NULL, PRIMARY KEY (group_key, receiver));
CREATE TABLE IF NOT EXISTS episodes (
    id INTEGER PRIMARY KEY, fingerprint TEXT NOT NULL, alertname TEXT NOT NULL, scope TEXT NOT NULL,
    level TEXT NOT NULL, starts_at REAL NOT NULL, ends_at REAL);
CREATE INDEX IF NOT EXISTS episodes_open ON episodes (fingerprint) WHERE ends_at IS NULL;
CREATE INDEX IF NOT EXISTS episodes_start ON episodes (starts_at);
CREATE TABLE IF NOT EXISTS silences (id TEXT PRIMARY KEY, silence TEXT NOT NULL, ends_at REAL NOT NULL);
"""


class StoreError(RuntimeError):
    pass


@dataclass(frozen=True)
class NotifyRecord:
    """What ``receiver`` was last told about group ``group_key``, and when."""

    group_key: str
    receiver: str
    firing: frozenset[str]
    resolved: frozenset[str]
    sent_at: float


@dataclass(frozen=True)
class Episode:
    """One firing of an alert, from start to resolution (``ends_at`` None while firing)."""

    fingerprint: str
    alertname: str
    scope: str
    level: Level
    starts_at: float
    ends_at: float | None


class AlertStore:
    def __init__(self, path: str | Path) -> None:
        self.path = str(path)
        if self.path != ":memory:":
            Path(self.path).parent.mkdir(parents=True, exist_ok=True)
        try:
            self._db = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=NORMAL")
            self._db.executescript(_TABLES)
        except sqlite3.Error as error:
            raise StoreError(f"alert store {self.path}: {error}") from None
        version = self.get_meta("schema")
        if version is None:
            self.set_meta("schema", str(SCHEMA))
        elif int(version) > SCHEMA:
            raise StoreError(f"alert store {self.path}: schema {version} is newer than this rankwatch ({SCHEMA})")

    def close(self) -> None:
        self._db.close()

    # -- alerts ---------------------------------------------------------------------------------

    def save_alerts(self, alerts: Iterable[Alert], now: float) -> None:
        """Keep the alerts and their history, in one transaction."""
        with self._transaction() as db:
            for alert in alerts:
                fp = alert.fingerprint
                db.execute(
                    "INSERT OR REPLACE INTO alerts (fingerprint, alert) VALUES (?, ?)",
                    (fp, json.dumps(alert.to_json(), separators=(",", ":"))),
                )
                open_episode = db.execute(
                    "SELECT id FROM episodes WHERE fingerprint = ? AND ends_at IS NULL", (fp,)
                ).fetchone()
                if alert.resolved(now):
                    if open_episode:
                        db.execute("UPDATE episodes SET ends_at = ? WHERE id = ?", (alert.ends_at, open_episode[0]))
                elif open_episode is None:
                    db.execute(
                        "INSERT INTO episodes (fingerprint, alertname, scope, level, starts_at) VALUES (?, ?, ?, ?, ?)",
                        (fp, alert.name, job_of(alert) or node_of(alert), alert.level.value, alert.starts_at),
                    )
                else:
                    db.execute("UPDATE episodes SET level = ? WHERE id = ?", (alert.level.value, open_episode[0]))

    def load_alerts(self) -> list[Alert]:
        return [Alert.from_json(json.loads(row[0])) for row in self._db.execute("SELECT alert FROM alerts")]

    def forget_alerts(self, fingerprints: Iterable[str]) -> None:
        with self._transaction() as db:
            db.executemany("DELETE FROM alerts WHERE fingerprint = ?", ((fp,) for fp in fingerprints))

    # -- notification log -----------------------------------------------------------------------

    def load_notify_log(self) -> dict[tuple[str, str], NotifyRecord]:
        rows = self._db.execute("SELECT group_key, receiver, firing, resolved, sent_at FROM nlog")
        return {
            (g, r): NotifyRecord(g, r, frozenset(json.loads(f)), frozenset(json.loads(s)), t) for g, r, f, s, t in rows
        }

    def record_notified(self, records: Iterable[NotifyRecord], retired: Iterable[str] = ()) -> None:
        """What receivers were told, and the resolved alerts no longer needed, in one transaction."""
        with self._transaction() as db:
            db.executemany(
                "INSERT OR REPLACE INTO nlog (group_key, receiver, firing, resolved, sent_at) VALUES (?, ?, ?, ?, ?)",
                (
                    (r.group_key, r.receiver, json.dumps(sorted(r.firing)), json.dumps(sorted(r.resolved)), r.sent_at)
                    for r in records
                ),
            )
            db.executemany("DELETE FROM alerts WHERE fingerprint = ?", ((fp,) for fp in retired))

    def forget_groups(self, keys: Iterable[tuple[str, str]]) -> None:
        with self._transaction() as db:
            db.executemany("DELETE FROM nlog WHERE group_key = ? AND receiver = ?", keys)

    # -- silences -------------------------------------------------------------------------------

    def save_silence(self, silence: Silence) -> None:
        with self._transaction() as db:
            db.execute(
                "INSERT OR REPLACE INTO silences (id, silence, ends_at) VALUES (?, ?, ?)",
                (silence.id, json.dumps(silence_to_data(silence)), silence.ends_at),
            )

    def load_silences(self, now: float) -> list[Silence]:
        with self._transaction() as db:
            db.execute("DELETE FROM silences WHERE ends_at <= ?", (now,))
        return [silence_from_data(json.loads(raw)) for (raw,) in self._db.execute("SELECT silence FROM silences")]

    def delete_silence(self, silence_id: str) -> bool:
        with self._transaction() as db:
            return db.execute("DELETE FROM silences WHERE id = ?", (silence_id,)).rowcount > 0

    # -- history --------------------------------------------------------------------------------

    def episodes(self, start: float, end: float) -> list[Episode]:
        """Firings that started in [start, end)."""
        rows = self._db.execute(
            "SELECT fingerprint, alertname, scope, level, starts_at, ends_at FROM episodes "
            "WHERE starts_at >= ? AND starts_at < ? ORDER BY starts_at",
            (start, end),
        )
        return [Episode(fp, name, scope, Level(level), s, e) for fp, name, scope, level, s, e in rows]

    def prune(self, before: float) -> int:
        with self._transaction() as db:
            return db.execute("DELETE FROM episodes WHERE ends_at IS NOT NULL AND ends_at < ?", (before,)).rowcount

    # -- meta -----------------------------------------------------------------------------------

    def get_meta(self, key: str) -> str | None:
        row = self._db.execute("SELECT value FROM meta WHERE key = ?", (key,)).fetchone()
        return row[0] if row else None

    def set_meta(self, key: str, value: str) -> None:
        with self._transaction() as db:
            db.execute("INSERT OR REPLACE INTO meta (key, value) VALUES (?, ?)", (key, value))

    def _transaction(self) -> _Transaction:
        return _Transaction(self._db)


def silence_to_data(silence: Silence) -> dict[str, Any]:
    return {**silence.to_json(), "startsAt": silence.starts_at, "endsAt": silence.ends_at}


def silence_from_data(data: dict[str, Any]) -> Silence:
    return Silence(
        matchers=tuple(Matcher.parse(m) for m in data["matchers"]),
        starts_at=data["startsAt"],
        ends_at=data["endsAt"],
        created_by=data.get("createdBy", ""),
        comment=data.get("comment", ""),
        id=data["id"],
    )


class _Transaction:
    def __init__(self, db: sqlite3.Connection) -> None:
        self.db = db

    def __enter__(self) -> sqlite3.Connection:
        self.db.execute("BEGIN IMMEDIATE")
        return self.db

    def __exit__(self, kind: object, *_: object) -> None:
        self.db.execute("COMMIT" if kind is None else "ROLLBACK")
