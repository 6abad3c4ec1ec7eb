"""Alerting: P0–P3 alerts from job findings and Alertmanager, routed to Feishu cards, phone calls and webhooks.

The operator uses:

- ``load_config(text, secrets=kubernetes_resolver(namespace, kube))`` once at startup;
- ``AlertPipeline(config, store=open_store(config.store, kube, namespace))``: ``await start()`` /
  ``await stop()`` in the operator's event loop,
  ``await submit([alert_from_finding(namespace, job, finding, route, level)])`` when a diagnosis
  finds something (``route`` and ``level``: the job's ``spec.alerting``),
  ``await resolve(labels={"namespace": ns, "trainingjob": job})`` when it clears;
- ``add_routes(app, pipeline)`` on its aiohttp app for the Alertmanager webhook and silences.
"""

from rankwatch.alerting.cluster_store import open_store
from rankwatch.alerting.config import AlertingConfig, ConfigError, load_config
from rankwatch.alerting.delivery import DeliveryError
from rankwatch.alerting.findings import alert_from_finding
from rankwatch.alerting.intake import add_routes, alerts_from_alertmanager, serve
from rankwatch.alerting.model import Alert, Level
from rankwatch.alerting.pipeline import AlertPipeline
from rankwatch.alerting.secrets import Secret, file_resolver, kubernetes_resolver, mapping_resolver

__all__ = [
    "Alert",
    "AlertPipeline",
    "AlertingConfig",
    "ConfigError",
    "DeliveryError",
    "Level",
    "Secret",
    "add_routes",
    "alert_from_finding",
    "alerts_from_alertmanager",
    "file_resolver",
    "kubernetes_resolver",
    "load_config",
    "mapping_resolver",
    "open_store",
    "serve",
]
