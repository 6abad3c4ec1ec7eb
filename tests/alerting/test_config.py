"""The alerting config: the example loads; every mistake is refused with the path of the bad field."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from alerting_support import SIGNING_SECRET, config_data, merge, secrets_for

from rankwatch.alerting import ConfigError, load_config, mapping_resolver
from rankwatch.alerting.config import FeishuBot, FeishuPhone, Webhook, parse_duration
from rankwatch.alerting.model import Level

EXAMPLE = Path(__file__).parents[2] / "examples" / "alerting.yaml"
EXAMPLE_SECRETS = mapping_resolver(
    {
        "rankwatch-feishu": {"webhook-url": "https://open.feishu.cn/open-apis/bot/v2/hook/abc", "signing-secret": "s"},
        "rankwatch-feishu-app": {"app-id": "cli_1", "app-secret": "x"},
        "rankwatch-intake": {"token": "t"},
    }
)


def test_the_example_config_loads():
    config = load_config(EXAMPLE, EXAMPLE_SECRETS)
    assert [type(r.integration) for r in config.receivers.values()] == [FeishuBot, FeishuPhone, Webhook]
    phone_route = config.route.routes[0]
    assert (phone_route.receiver, phone_route.continue_, phone_route.repeat_interval) == ("oncall-phone", True, 1800)
    assert phone_route.group_wait == 30 and phone_route.group_by == config.route.group_by  # inherited
    assert config.report.weekday == 0 and (config.report.hour, config.report.minute) == (9, 0)
    assert config.intake.severity_levels["critical"] == Level.P1
    assert config.intake.bearer_token is not None, "the intake is closed without its token"
    assert config.silences[0].created_by == "alice"


def load(feishu, **changes):
    return load_config(yaml.safe_dump(merge(config_data(feishu, "/tmp/x.sqlite"), changes)), secrets_for(feishu))


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"route": {"routes": [{}, {"group_wait": "5x"}]}}, r"route.routes\[1\].group_wait: '5x' is not a duration"),
        ({"route": {"recevier": "team"}}, r"route: unknown field 'recevier' \(known: continue, group_by"),
        ({"route": {"routes": [{"receiver": "pager"}]}}, r"route.routes\[0\].receiver: no receiver named 'pager'"),
        (
            {"route": {"routes": [{"matchers": ["level=P0", "node=~(("]}]}},
            r"route.routes\[0\].matchers\[1\]: .*regular",
        ),
        ({"route": {"repeat_interval": "0s"}}, r"route.repeat_interval: '0s' must be positive"),
        ({"storm": {"max_alerts": 0}}, r"storm.max_alerts: expected a whole number >= 1, got 0"),
        ({"report": {"receiver": "oncall-phone"}}, r"report.receiver: 'oncall-phone' is a phone receiver"),
        ({"report": {"time": "25:00"}}, r"report.time: '25:00' is not HH:MM"),
        ({"report": {"timezone": "Mars/Olympus"}}, r"report.timezone: unknown time zone"),
        ({"intake": {"severity_levels": {"critical": "P9"}}}, r"intake.severity_levels.critical: 'P9' is not a level"),
        ({"inhibit_rules": [{"source_matchers": [], "target_matchers": ["a=b"]}]}, r"inhibit_rules\[0\]: .*empty"),
        ({"silences": [{"matchers": ["a=b"], "ends_at": "soon"}]}, r"silences\[0\].ends_at: 'soon' is not an RFC 3339"),
        ({"route": {"matchers": ["a=b"]}}, r"route.matchers: the root route matches every alert"),
    ],
)
def test_mistakes_name_the_field(feishu, changes, message):
    with pytest.raises(ConfigError, match=message):
        load(feishu, **changes)


def test_receiver_mistakes_name_the_receiver(feishu):
    data = config_data(feishu, "/tmp/x.sqlite")
    data["receivers"][0]["feishu"]["secret"] = SIGNING_SECRET
    with pytest.raises(ConfigError, match=r"receivers\[0\].feishu.secret: a credential must come from a Secret"):
        load_config(yaml.safe_dump(data), secrets_for(feishu))
    data = config_data(feishu, "/tmp/x.sqlite")
    data["receivers"][0]["feishu"]["secret"] = {"secretKeyRef": {"name": "feishu-bot", "key": "nope"}}
    with pytest.raises(ConfigError, match=r"receivers\[0\].feishu.secret: secrets has no Secret 'feishu-bot' with key"):
        load_config(yaml.safe_dump(data), secrets_for(feishu))
    data = config_data(feishu, "/tmp/x.sqlite")
    data["receivers"][2]["feishu"] = {}
    with pytest.raises(ConfigError, match=r"receivers\[2\] \(ops-hook\): give exactly one of feishu"):
        load_config(yaml.safe_dump(data), secrets_for(feishu))


def test_a_bad_url_in_a_secret_is_reported_without_its_value(feishu):
    resolver = mapping_resolver({"feishu-bot": {"webhook-url": "ftp://t0p-secret-token", "signing-secret": "x"}})
    data = config_data(feishu, "/tmp/x.sqlite")
    data["receivers"] = data["receivers"][:1]
    data["route"]["routes"] = []
    with pytest.raises(ConfigError, match=r"webhook_url \(feishu-bot/webhook-url\): not an http") as raised:
        load_config(yaml.safe_dump(data), resolver)
    assert "t0p-secret-token" not in str(raised.value)


def test_secret_values_do_not_appear_in_the_config_repr(feishu):
    assert SIGNING_SECRET not in repr(load(feishu))


@pytest.mark.parametrize(("text", "seconds"), [("30s", 30), ("5m", 300), ("1h30m", 5400), ("250ms", 0.25), (7, 7)])
def test_durations(text, seconds):
    assert parse_duration(text) == seconds
