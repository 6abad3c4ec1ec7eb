"""Alertmanager webhook intake: real payloads in, the right Feishu card out; silences over HTTP."""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import json
import time

import aiohttp
import pytest
import yaml
from alerting_support import INTAKE_TOKEN, config_data, wait_for

from rankwatch.alerting.config import IntakeConfig
from rankwatch.alerting.intake import IntakeError, alerts_from_alertmanager, serve
from rankwatch.alerting.model import Level

STARTED = int(time.time()) - 3600
STARTS_AT = time.strftime("%Y-%m-%dT%H:%M:%S.123456789Z", time.gmtime(STARTED))

# As Alertmanager 0.27 posts it to a webhook receiver (fields, nanosecond times, zero endsAt).
PAYLOAD = {
    "receiver": "rankwatch",
    "status": "firing",
    "alerts": [
        {
            "status": "firing",
            "labels": {
                "alertname": "GPUFellOffTheBus",
                "gpu": "5",
                "instance": "10.0.4.17:9400",
                "job": "dcgm-exporter",
                "node": "gpu-node-3",
                "severity": "P0",
            },
            "annotations": {
                "summary": "GPU 5 on gpu-node-3 fell off the bus (XID 79)",
                "description": "DCGM reports XID 79 on GPU 5 for 2m; the GPU is gone until the node reboots.",
                "runbook_url": "https://runbooks.example.com/gpu-xid-79",
            },
            "startsAt": STARTS_AT,
            "endsAt": "0001-01-01T00:00:00Z",
            "generatorURL": "http://prometheus-k8s-0:9090/graph?g0.expr=DCGM_FI_DEV_XID_ERRORS+%3D%3D+79&g0.tab=1",
            "fingerprint": "7be7c3b3b04c2f44",
        }
    ],
    "groupLabels": {"alertname": "GPUFellOffTheBus"},
    "commonLabels": {"alertname": "GPUFellOffTheBus", "severity": "P0"},
    "commonAnnotations": {},
    "externalURL": "http://alertmanager-main-0:9093",
    "version": "4",
    "groupKey": '{}/{severity=~"P0|P1"}:{alertname="GPUFellOffTheBus"}',
    "truncatedAlerts": 0,
}


AUTHORIZED = {"Authorization": f"Bearer {INTAKE_TOKEN}"}


async def post(url: str, payload, token: str | None = INTAKE_TOKEN) -> aiohttp.ClientResponse:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    async with aiohttp.ClientSession() as session, session.post(url, json=payload, headers=headers) as response:
        await response.read()
        return response


async def test_an_alertmanager_payload_produces_the_right_feishu_card_and_pages(feishu, pipelines):
    pipeline = await pipelines()
    runner, port = await serve(pipeline)
    try:
        response = await post(f"http://127.0.0.1:{port}/alerting/alertmanager", PAYLOAD)
        assert response.status == 200
        await wait_for(lambda: feishu.cards() and len(feishu.calls) == 3, what="the card and the calls")
    finally:
        await runner.cleanup()
    (card,) = feishu.cards()
    assert card["header"] == {
        "template": "red",
        "title": {"tag": "plain_text", "content": "[P0] GPUFellOffTheBus · gpu-node-3"},  # not the scrape job
    }
    text = json.dumps(card, ensure_ascii=False)
    fields = [f["text"]["content"] for f in card["elements"][0]["fields"]]
    assert fields == ["**Job**\n—", "**Node**\ngpu-node-3", "**Rank**\n—", "**Level**\nP0"]
    assert "GPU 5 on gpu-node-3 fell off the bus (XID 79)" in text
    assert "DCGM reports XID 79 on GPU 5 for 2m" in text  # the description as evidence
    assert "**Started** " + time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(STARTED)) in text
    buttons = [a for e in card["elements"] if e["tag"] == "action" for a in e["actions"]]
    assert [b["url"] for b in buttons] == [
        PAYLOAD["alerts"][0]["generatorURL"],
        "https://runbooks.example.com/gpu-xid-79",
    ]


async def test_alertmanager_resolved_payload_sends_the_green_notice(feishu, pipelines):
    pipeline = await pipelines()
    runner, port = await serve(pipeline)
    try:
        await post(f"http://127.0.0.1:{port}/alerting/alertmanager", PAYLOAD)
        await wait_for(lambda: feishu.cards())
        resolved = copy.deepcopy(PAYLOAD)
        resolved["status"] = resolved["alerts"][0]["status"] = "resolved"
        resolved["alerts"][0]["endsAt"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(STARTED + 29 * 60 + 30))
        await post(f"http://127.0.0.1:{port}/alerting/alertmanager", resolved)
        await wait_for(lambda: len(feishu.cards()) == 2)
    finally:
        await runner.cleanup()
    assert feishu.cards()[1]["header"]["template"] == "green"
    assert "after 29m29s" in json.dumps(feishu.cards()[1])


@pytest.mark.parametrize(
    ("severity", "level"),
    [
        ("P0", Level.P0),
        ("p2", Level.P2),
        ("critical", Level.P1),
        ("warning", Level.P2),
        ("info", Level.P3),
        (None, Level.P3),
    ],
)
def test_level_comes_from_the_severity_label(severity, level):
    payload = copy.deepcopy(PAYLOAD)
    labels = payload["alerts"][0]["labels"]
    labels.pop("severity")
    if severity:
        labels["severity"] = severity
    (alert,) = alerts_from_alertmanager(payload, IntakeConfig(), now=2e9)
    assert alert.level == level and alert.source == "alertmanager"


def test_severity_mapping_can_be_changed():
    payload = copy.deepcopy(PAYLOAD)
    payload["alerts"][0]["labels"]["severity"] = "critical"
    (alert,) = alerts_from_alertmanager(payload, IntakeConfig(severity_levels={"critical": Level.P0}), now=2e9)
    assert alert.level == Level.P0


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"version": "3"}, "unsupported payload version '3'"),
        ({"alerts": {}}, "alerts: expected a list"),
        ({"alerts": [{"labels": {}}]}, r"alerts\[0\].labels: expected a non-empty object"),
        ({"alerts": [{"labels": {"a": "b"}, "startsAt": "yesterday"}]}, r"alerts\[0\].startsAt: 'yesterday'"),
    ],
)
def test_bad_payloads_are_refused_naming_the_field(change, message):
    with pytest.raises(IntakeError, match=message):
        alerts_from_alertmanager({**PAYLOAD, **change}, IntakeConfig(), now=2e9)


async def test_the_intake_wants_its_bearer_token(feishu, pipelines):
    pipeline = await pipelines()
    runner, port = await serve(pipeline)
    url = f"http://127.0.0.1:{port}/alerting/alertmanager"
    try:
        assert (await post(url, PAYLOAD, token=None)).status == 401
        assert (await post(url, PAYLOAD, token="guess")).status == 401
        assert (await post(url, {"version": "4"}, token="intake-t0ken")).status == 400
        assert (await post(url, PAYLOAD, token="intake-t0ken")).status == 200
    finally:
        await runner.cleanup()


async def test_silences_over_http(feishu, pipelines):
    pipeline = await pipelines()
    runner, port = await serve(pipeline)
    base = f"http://127.0.0.1:{port}/alerting"
    try:
        async with aiohttp.ClientSession(headers=AUTHORIZED) as session:
            async with session.post(
                f"{base}/silences", json={"matchers": ['node="gpu-node-3"'], "duration": "2h", "createdBy": "bob"}
            ) as response:
                assert response.status == 201
                silence = await response.json()
            async with session.post(f"{base}/silences", json={"matchers": ["node=~("], "duration": "2h"}) as bad:
                assert bad.status == 400 and "bad regular expression" in await bad.text()
            await post(f"{base}/alertmanager", PAYLOAD)
            await asyncio.sleep(0.3)
            assert feishu.cards() == []
            async with session.get(f"{base}/silences") as listed:
                assert [s["id"] for s in await listed.json()] == [silence["id"]]
            async with session.delete(f"{base}/silences/{silence['id']}") as expired:
                assert expired.status == 200
        await wait_for(lambda: feishu.cards(), what="the card once the silence was expired")
    finally:
        await runner.cleanup()


async def test_without_a_configured_token_the_intake_is_closed(feishu, pipelines):
    """No token in the config does not mean anyone may post alerts or silences: every endpoint is 401."""
    pipeline = await pipelines()
    pipeline.config = dataclasses.replace(pipeline.config, intake=IntakeConfig())  # as loaded from no intake:
    runner, port = await serve(pipeline)
    base = f"http://127.0.0.1:{port}/alerting"
    try:
        async with aiohttp.ClientSession() as session:
            for method, path, body in (
                ("POST", "/alertmanager", PAYLOAD),
                ("POST", "/silences", {"matchers": ['node="gpu-node-3"'], "duration": "2h"}),
                ("GET", "/silences", None),
                ("GET", "/alerts", None),
            ):
                async with session.request(method, base + path, json=body) as response:
                    text = await response.text()
                    assert response.status == 401 and "intake.bearer_token" in text, (path, text)
        assert pipeline.silences() == []
    finally:
        await runner.cleanup()


@pytest.mark.parametrize(
    ("pattern", "reason"),
    [
        (r"(a)\1", "invalid escape sequence"),
        ("(?=x)y", "invalid perl operator"),
        ("((a{100}){100}){100}", "invalid repetition size"),
        ("a" * 1025, "the limit is 1024"),
    ],
)
async def test_silence_patterns_outside_re2_are_refused_naming_why(feishu, pipelines, pattern, reason):
    pipeline = await pipelines()
    runner, port = await serve(pipeline)
    try:
        async with (
            aiohttp.ClientSession(headers=AUTHORIZED) as session,
            session.post(f"http://127.0.0.1:{port}/alerting/silences",
                         json={"matchers": [f"node=~{json.dumps(pattern)}"], "duration": "1h"}) as response,
        ):  # fmt: skip
            text = await response.text()
        assert response.status == 400 and "bad regular expression" in text and reason in text, text
    finally:
        await runner.cleanup()


async def test_a_backtracking_silence_pattern_matches_a_long_label_at_once(feishu, pipelines):
    """(x+x+)+y against 50,000 x's backtracks for ever in Python's re; RE2 answers in linear time, and the
    intake goes on serving while the silence is checked against every alert."""
    pipeline = await pipelines()
    runner, port = await serve(pipeline)
    base = f"http://127.0.0.1:{port}/alerting"
    payload = copy.deepcopy(PAYLOAD)
    payload["alerts"][0]["labels"]["node"] = "x" * 50_000
    try:
        async with aiohttp.ClientSession(headers=AUTHORIZED) as session:
            silence = {"matchers": ['node=~"(x+x+)+y"'], "duration": "1h"}
            async with session.post(f"{base}/silences", json=silence) as response:
                assert response.status == 201
            started = time.monotonic()
            async with session.post(f"{base}/alertmanager", json=payload) as response:
                assert response.status == 200
            await wait_for(lambda: feishu.cards(), what="the card: the silence does not match")
            assert time.monotonic() - started < 5
    finally:
        await runner.cleanup()


def test_alerts_serve_refuses_to_start_without_an_intake_token(feishu, tmp_path, capsys):

    from rankwatch.alerting.commands import serve as serve_command

    data = config_data(feishu, str(tmp_path / "alerts.sqlite"))
    del data["intake"]
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(data))
    secrets = {"feishu-bot": {"webhook-url": "http://127.0.0.1:1/bot", "signing-secret": "s"},
               "feishu-app": {"app-id": "a", "app-secret": "b"}}  # fmt: skip
    (tmp_path / "secrets.yaml").write_text(yaml.safe_dump(secrets))
    code = serve_command(str(tmp_path / "config.yaml"), str(tmp_path / "secrets.yaml"), None, "127.0.0.1:0")
    assert code == 1 and "intake.bearer_token" in capsys.readouterr().err
