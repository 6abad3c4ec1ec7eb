"""`rankwatch alerts silence add|ls|rm` against a running pipeline's intake (real HTTP on 127.0.0.1, the
local Feishu): a silence starts when it says, and a bad duration or time is answered in words."""

from __future__ import annotations

import asyncio
import datetime
import json
import sys
import time

import aiohttp
from alerting_support import INTAKE_TOKEN, wait_for

from rankwatch.alerting.intake import serve

NODE = "gpu-node-3"


def alertmanager_payload(alertname: str) -> dict:
    starts = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(time.time() - 60))
    alert = {"status": "firing", "labels": {"alertname": alertname, "node": NODE, "severity": "P2"},
             "annotations": {"summary": f"{alertname} on {NODE}"}, "startsAt": starts,
             "endsAt": "0001-01-01T00:00:00Z"}  # fmt: skip
    return {"version": "4", "status": "firing", "receiver": "rankwatch", "alerts": [alert]}


async def silence_cli(url: str, *args: str) -> tuple[int, str, str]:
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "rankwatch", "alerts", "silence", *args, "--url", url,
        env={"RANKWATCH_INTAKE_TOKEN": INTAKE_TOKEN, "PATH": "/usr/bin:/bin"},
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    out, err = await process.communicate()
    return process.returncode, out.decode(), err.decode()


async def alert(url: str, alertname: str) -> None:
    headers = {"Authorization": f"Bearer {INTAKE_TOKEN}"}
    async with (
        aiohttp.ClientSession(headers=headers) as session,
        session.post(f"{url}/alertmanager", json=alertmanager_payload(alertname)) as response,
    ):
        assert response.status == 200, await response.text()


def titles(feishu) -> list[str]:
    return [card["header"]["title"]["content"] for card in feishu.cards()]


async def test_a_silence_starting_later_mutes_nothing_now_and_ls_and_rm_show_it(feishu, pipelines):
    pipeline = await pipelines()
    runner, port = await serve(pipeline)
    url = f"http://127.0.0.1:{port}/alerting"
    try:
        later = (datetime.datetime.now(datetime.UTC) + datetime.timedelta(hours=1)).strftime("%Y-%m-%dT%H:%M:%SZ")
        code, out, err = await silence_cli(url, "add", f'node="{NODE}"', "--starts-at", later, "--duration", "2h",
                                           "--comment", "maintenance window")  # fmt: skip
        assert code == 0, err
        silence_id, state = out.split()[:2]
        assert state == "pending" and f"from {later} to " in out
        await alert(url, "NodeDown")
        await wait_for(lambda: any("NodeDown" in t for t in titles(feishu)), 30, "the card: the silence starts later")

        code, out, err = await silence_cli(url, "add", f'node="{NODE}"', "-d", "30m", "--created-by", "alice")
        assert code == 0, err
        active_id = out.split()[0]
        await alert(url, "GpuHot")
        code, listing, _ = await silence_cli(url, "ls")
        rows = {line.split()[0]: line for line in listing.splitlines()[1:]}
        assert set(rows) == {silence_id, active_id}
        assert rows[silence_id].split()[1:3] == ["pending", later] and "maintenance window" in rows[silence_id]
        assert rows[active_id].split()[1] == "active" and "alice" in rows[active_id]
        await asyncio.sleep(0.5)  # the pipeline has had time to notify what it would
        assert not any("GpuHot" in t for t in titles(feishu)), "the active silence mutes"

        code, out, err = await silence_cli(url, "rm", active_id)
        assert (code, out.strip()) == (0, f"{active_id}: expired"), err
        code, listing, _ = await silence_cli(url, "ls", "-o", "json")
        assert [s["id"] for s in json.loads(listing)] == [silence_id]
        code, _, err = await silence_cli(url, "rm", active_id)
        assert code == 1 and "no such silence" in err
    finally:
        await runner.cleanup()


async def test_bad_durations_and_times_are_answered_in_words(feishu, pipelines):
    pipeline = await pipelines()
    runner, port = await serve(pipeline)
    url = f"http://127.0.0.1:{port}/alerting"
    try:
        cases = [
            (["--duration", "2 hours"], "duration '2 hours' is not a duration (write e.g. 30m, 2h, 1h30m, 7d)"),
            (["--duration", "2h", "--starts-at", "tomorrow"], "startsAt 'tomorrow' is not an RFC 3339 time"),
            (["--duration", "2h", "--starts-at", "2026-12-01T08:00:00"], "has no time zone"),
            (["--ends-at", "2020-01-01T00:00:00Z"], "in the past"),
            ([], "give one of --duration (e.g. 2h) or --ends-at"),
        ]
        for flags, message in cases:
            code, _, err = await silence_cli(url, "add", f'node="{NODE}"', *flags)
            assert code == 1 and len(err.strip().splitlines()) == 1, err
            assert err.startswith("rankwatch alerts silence add: ") and message in err, err
        assert pipeline.silences() == []
        code, _, err = await silence_cli("http://127.0.0.1:9/alerting", "ls")
        assert code == 1 and "cannot reach the intake at http://127.0.0.1:9/alerting" in err
    finally:
        await runner.cleanup()
