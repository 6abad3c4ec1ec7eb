"""The weekly report: counts, top alerts, mean time to resolve; on schedule once, and from the CLI."""

from __future__ import annotations

import asyncio
import datetime
import json
import sys
import time

import yaml
from alerting_support import (
    APP_ID,
    APP_SECRET,
    BOT_TOKEN,
    INTAKE_TOKEN,
    SIGNING_SECRET,
    config_data,
    job_alert,
    wait_for,
)

from rankwatch.alerting.config import ReportConfig
from rankwatch.alerting.model import Alert, Level
from rankwatch.alerting.pipeline import REPORT_SLOT
from rankwatch.alerting.report import WEEK, last_slot, weekly_report
from rankwatch.alerting.store import AlertStore

NOW = datetime.datetime(2026, 11, 23, 9, 0, tzinfo=datetime.UTC).timestamp()  # a Monday
HOUR = 3600.0


def history(store: AlertStore) -> None:
    def fire(alert: Alert, at: float, minutes: float | None) -> None:
        alert = Alert(alert.labels, alert.level, at, alert.annotations)
        store.save_alerts([alert], at)
        if minutes is not None:
            store.save_alerts([alert.resolve(at + minutes * 60)], at + minutes * 60)

    hang = job_alert(level=Level.P0, name="TrainingJobHang")
    for day in range(3):  # the same hang three times this week: 10, 20, 30 minutes
        fire(hang, NOW - (day + 1) * 24 * HOUR, 10 * (day + 1))
    fire(job_alert(node="gpu-node-4"), NOW - 5 * HOUR, None)  # still firing
    fire(job_alert(level=Level.P2, node="gpu-node-5", name="TrainingJobFailSlow"), NOW - 2 * HOUR, 60)
    fire(job_alert(level=Level.P3, name="Old"), NOW - 8 * 24 * HOUR, 5)  # last week: not counted


def test_report_counts_levels_ranks_top_alerts_and_averages_time_to_resolve(tmp_path):
    store = AlertStore(tmp_path / "a.sqlite")
    history(store)
    report = weekly_report(store, "team", NOW)
    assert report.counts == {Level.P0: 3, Level.P1: 1, Level.P2: 1, Level.P3: 0}
    assert (
        report.top[0].name == "TrainingJobHang" and report.top[0].count == 3 and report.top[0].scope == "ml/llama-70b"
    )
    assert (report.resolved, report.still_firing) == (4, 1)
    assert report.mean_time_to_resolve == (10 + 20 + 30 + 60) * 60 / 4
    assert report.start == NOW - WEEK


def test_the_report_slot_is_the_last_scheduled_time_in_the_zone():
    monday_nine_shanghai = ReportConfig(weekday=0, hour=9, minute=0, timezone="Asia/Shanghai")
    slot = last_slot(monday_nine_shanghai, NOW)  # Monday 09:00 UTC is 17:00 in Shanghai: today 01:00 UTC
    assert slot == NOW - 8 * HOUR
    assert last_slot(monday_nine_shanghai, slot - 1) == slot - WEEK


async def test_the_scheduled_report_is_sent_once_even_across_restarts(feishu, pipelines, tmp_path):
    store = AlertStore(tmp_path / "alerts.sqlite")
    history(store)
    store.set_meta(REPORT_SLOT, repr(last_slot(ReportConfig(), time.time()) - WEEK))  # last week's was sent
    store.close()
    schedule = {"report": {"receiver": "team", "weekday": "monday", "time": "09:00"}}

    def reports() -> list[dict]:
        return [c for c in feishu.cards() if c["header"]["title"]["content"].startswith("Weekly alert report ")]

    first = await pipelines(schedule)
    await wait_for(reports, what="the scheduled report")
    await first.stop()
    await pipelines(schedule)
    await asyncio.sleep(0.3)
    assert len(reports()) == 1


async def test_no_report_of_the_past_on_the_very_first_start(feishu, pipelines):
    await pipelines({"report": {"receiver": "team"}})
    await asyncio.sleep(0.3)
    assert feishu.cards() == []


async def run_cli(*args: str) -> tuple[int, str, str]:
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "rankwatch",
        "alerts",
        *args,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await process.communicate()
    return process.returncode, out.decode(), err.decode()


def cli_files(feishu, tmp_path, signing_secret: str = SIGNING_SECRET) -> list[str]:
    config = config_data(feishu, str(tmp_path / "alerts.sqlite"))
    config["report"] = {"receiver": "team"}
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(config))
    secrets = {
        "feishu-bot": {"webhook-url": feishu.bot_url(BOT_TOKEN), "signing-secret": signing_secret},
        "feishu-app": {"app-id": APP_ID, "app-secret": APP_SECRET},
        "intake": {"token": INTAKE_TOKEN},
    }
    (tmp_path / "secrets.yaml").write_text(yaml.safe_dump(secrets))
    return ["--config", str(tmp_path / "config.yaml"), "--secrets", str(tmp_path / "secrets.yaml")]


async def test_cli_report_sends_the_report_card_now(feishu, tmp_path):
    store = AlertStore(tmp_path / "alerts.sqlite")
    now = time.time()
    store.save_alerts([Alert(job_alert().labels, Level.P1, now - 600)], now)
    store.close()
    code, out, err = await run_cli("report", *cli_files(feishu, tmp_path))
    assert code == 0, err
    assert "sent the weekly report to team: 1 alerts (P0 0, P1 1, P2 0, P3 0)" in out
    (card,) = feishu.cards()
    assert card["header"]["template"] == "indigo"
    assert "TrainingJobStraggler · ml/llama-70b: 1×" in json.dumps(card, ensure_ascii=False)


async def test_cli_test_sends_a_test_card_and_rings_a_phone_receiver(feishu, tmp_path):
    files = cli_files(feishu, tmp_path)
    code, out, err = await run_cli("test", *files, "--receiver", "team", "--level", "P1")
    assert (code, out.strip()) == (0, "sent a P1 test card to team"), err
    assert feishu.cards()[0]["header"]["template"] == "orange"
    code, out, _ = await run_cli("test", *files, "--receiver", "oncall-phone", "--level", "P0")
    assert code == 0 and len(feishu.calls) == 3


async def test_cli_test_with_a_bad_signing_secret_says_so(feishu, tmp_path):
    code, _, err = await run_cli("test", *cli_files(feishu, tmp_path, "wr0ng-s3cret"), "--receiver", "team")
    assert code == 1
    assert "Feishu rejected the signature (code 19021" in err and "Secret feishu-bot/signing-secret" in err
    assert "wr0ng-s3cret" not in err and BOT_TOKEN not in err


async def test_cli_serve_refuses_a_bad_listen_address_or_config_with_a_clear_error(feishu, tmp_path):
    files = cli_files(feishu, tmp_path)
    code, _, err = await run_cli("serve", *files, "--listen", "127.0.0.1:http")
    assert code == 2 and "--listen '127.0.0.1:http': expected HOST:PORT" in err
    code, _, err = await run_cli("serve", "--config", str(tmp_path / "missing.yaml"), files[2], files[3])
    assert code == 1 and "missing.yaml" in err
