"""Receivers built from the config: one object per configured name."""

from __future__ import annotations

from rankwatch.alerting.config import AlertingConfig, FeishuBot, FeishuPhone
from rankwatch.alerting.delivery import Receiver
from rankwatch.alerting.feishu import FeishuBotReceiver
from rankwatch.alerting.phone import FeishuPhoneReceiver
from rankwatch.alerting.webhook import WebhookReceiver


def build_receivers(config: AlertingConfig) -> dict[str, Receiver]:
    receivers: dict[str, Receiver] = {}
    for name, receiver in config.receivers.items():
        integration = receiver.integration
        if isinstance(integration, FeishuBot):
            receivers[name] = FeishuBotReceiver(name, integration)
        elif isinstance(integration, FeishuPhone):
            receivers[name] = FeishuPhoneReceiver(name, integration)
        else:
            receivers[name] = WebhookReceiver(name, integration)
    return receivers
