"""A killed operator (SIGKILL, no clean stop) loses no alert and pages nothing twice."""

from __future__ import annotations

import asyncio
import signal
import sys
import textwrap

import yaml
from alerting_support import APP_ID, APP_SECRET, BOT_TOKEN, SIGNING_SECRET, config_data, merge, wait_for

from rankwatch.alerting import AlertPipeline, file_resolver, load_config

OPERATOR = textwrap.dedent(
    """
    import asyncio, sys, time
    from pathlib import Path
    from rankwatch.alerting import Alert, AlertPipeline, Level, file_resolver, load_config

    def alert(name, node):
        labels = {"alertname": name, "namespace": "ml", "trainingjob": "llama-70b", "node": node}
        return Alert(labels, Level.P0 if name == "TrainingJobHang" else Level.P1, time.time(), {"summary": name})

    async def main():
        pipeline = AlertPipeline(load_config(Path(sys.argv[1]), file_resolver(sys.argv[2])))
        await pipeline.start()
        await pipeline.submit([alert("TrainingJobHang", "gpu-node-1")])
        while not pipeline.store.load_notify_log() or pipeline._tasks:
            await asyncio.sleep(0.01)
        await pipeline.submit([alert("TrainingJobLater", "gpu-node-2")])
        print("ready", flush=True)
        await asyncio.sleep(3600)

    asyncio.run(main())
    """
)


def config(feishu, tmp_path, later_wait: str) -> dict:
    data = config_data(feishu, str(tmp_path / "alerts.sqlite"))
    later = {"matchers": ['alertname="TrainingJobLater"'], "receiver": "team", "group_wait": later_wait}
    return merge(data, {"route": {"routes": [later, *data["route"]["routes"]]}})


async def test_a_killed_operator_loses_nothing_and_repages_nothing(feishu, tmp_path):
    (tmp_path / "operator.py").write_text(OPERATOR)
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(config(feishu, tmp_path, later_wait="1h")))
    secrets = {
        "feishu-bot": {"webhook-url": feishu.bot_url(BOT_TOKEN), "signing-secret": SIGNING_SECRET},
        "feishu-app": {"app-id": APP_ID, "app-secret": APP_SECRET},
        "intake": {"token": "intake-t0ken"},
    }
    (tmp_path / "secrets.yaml").write_text(yaml.safe_dump(secrets))
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        str(tmp_path / "operator.py"),
        str(tmp_path / "config.yaml"),
        str(tmp_path / "secrets.yaml"),
        stdout=asyncio.subprocess.PIPE,
    )
    try:
        line = await asyncio.wait_for(process.stdout.readline(), timeout=30)
        assert line.strip() == b"ready"
    finally:
        process.send_signal(signal.SIGKILL)
        await process.wait()
    assert len(feishu.calls) == 3 and len(feishu.cards()) == 1  # the P0 was paged before the kill

    restarted = AlertPipeline(
        load_config(
            yaml.safe_dump(config(feishu, tmp_path, later_wait="50ms")), file_resolver(tmp_path / "secrets.yaml")
        )
    )
    await restarted.start()
    try:
        await wait_for(lambda: len(feishu.cards()) == 2, what="the alert stored before the kill")
        await asyncio.sleep(0.4)
    finally:
        await restarted.stop()
    assert feishu.cards()[1]["header"]["title"]["content"] == "[P1] TrainingJobLater · ml/llama-70b"
    assert len(feishu.calls) == 3 and len(feishu.cards()) == 2
