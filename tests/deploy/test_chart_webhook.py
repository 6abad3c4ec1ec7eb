"""The chart's admission webhook for pods of other kinds: off by default; when on, a configuration that
fails open, a certificate the API server can check, and the operator serving it."""

from __future__ import annotations

import base64
import datetime

from chart_support import by_kind, one
from cryptography import x509

from rankwatch.operator.config import OperatorConfig

ON = ("--set", "webhook.enabled=true")


def test_off_by_default(render):
    objects = render()
    assert not by_kind(objects, "MutatingWebhookConfiguration") and not by_kind(objects, "Secret")
    env = {
        e["name"]: e.get("value")
        for e in one(objects, "Deployment")["spec"]["template"]["spec"]["containers"][0]["env"]
    }
    assert env["RANKWATCH_WEBHOOK_LISTEN"] == "" and env["RANKWATCH_WEBHOOK_CERT_DIR"] == ""


def test_the_webhook_fails_open_and_only_looks_at_opted_in_namespaces(render):
    [hook] = one(render(*ON), "MutatingWebhookConfiguration")["webhooks"]
    assert hook["failurePolicy"] == "Ignore", "an operator that is down must never block a training job"
    assert hook["reinvocationPolicy"] == "IfNeeded"
    assert hook["sideEffects"] == "NoneOnDryRun"
    assert hook["namespaceSelector"] == {"matchLabels": {"rankwatch.io/inject": "enabled"}}
    assert hook["objectSelector"]["matchExpressions"] == [{"key": "rankwatch.io/job-name", "operator": "DoesNotExist"}]
    assert hook["rules"] == [
        {
            "apiGroups": [""],
            "apiVersions": ["v1"],
            "operations": ["CREATE"],
            "resources": ["pods"],
            "scope": "Namespaced",
        }
    ]
    assert hook["clientConfig"]["service"]["path"] == "/inject-pods"  # kinds/webhook.py WEBHOOK_ID


def test_the_chart_certificate_is_for_the_service_and_signed_by_the_configured_ca(render):
    objects = render(*ON, release="rw", namespace="ops")
    [hook] = one(objects, "MutatingWebhookConfiguration")["webhooks"]
    service = one(objects, "Service", "-webhook")
    assert hook["clientConfig"]["service"]["name"] == service["metadata"]["name"]
    secret = one(objects, "Secret", "-webhook-tls")
    certificate = x509.load_pem_x509_certificate(base64.b64decode(secret["data"]["tls.crt"]))
    ca = x509.load_pem_x509_certificate(base64.b64decode(hook["clientConfig"]["caBundle"]))
    certificate.verify_directly_issued_by(ca)
    names = certificate.extensions.get_extension_for_class(x509.SubjectAlternativeName).value.get_values_for_type(
        x509.DNSName
    )
    assert f"{service['metadata']['name']}.ops.svc" in names
    assert certificate.not_valid_after_utc > datetime.datetime.now(datetime.UTC) + datetime.timedelta(days=365)


def test_the_operator_serves_the_webhook_with_the_mounted_certificate(render, tmp_path):
    objects = render(*ON)
    pod = one(objects, "Deployment")["spec"]["template"]["spec"]
    container = pod["containers"][0]
    env = {e["name"]: e.get("value") for e in container["env"]}
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert env["RANKWATCH_WEBHOOK_LISTEN"] == f"0.0.0.0:{ports['webhook']}"
    mount = next(m for m in container["volumeMounts"] if m["name"] == "webhook-tls")
    assert mount["mountPath"] == env["RANKWATCH_WEBHOOK_CERT_DIR"]
    volume = next(v for v in pod["volumes"] if v["name"] == "webhook-tls")
    assert volume["secret"]["secretName"] == one(objects, "Secret", "-webhook-tls")["metadata"]["name"]
    assert one(objects, "Service", "-webhook")["spec"]["ports"][0]["targetPort"] == "webhook"
    # The operator accepts what the chart gives it (the Secret's files, as mounted).
    for item in volume["secret"]["items"]:
        (tmp_path / item["path"]).write_text("pem")
    config = OperatorConfig.from_env(
        {"RANKWATCH_WEBHOOK_LISTEN": env["RANKWATCH_WEBHOOK_LISTEN"], "RANKWATCH_WEBHOOK_CERT_DIR": str(tmp_path)}
    )
    assert config.webhook.listen == ("0.0.0.0", ports["webhook"])
    policy = one(objects, "NetworkPolicy", "-operator")  # the ingress one (the egress one is -operator-egress)
    assert {"ports": [{"port": "webhook", "protocol": "TCP"}]} in policy["spec"]["ingress"], "the API server reaches it"


def test_cert_manager_makes_the_certificate_and_injects_its_ca(render):
    objects = render(*ON, "--set", "webhook.certManager.enabled=true")
    configuration = one(objects, "MutatingWebhookConfiguration")
    certificate = one(objects, "Certificate")
    assert configuration["metadata"]["annotations"]["cert-manager.io/inject-ca-from"].endswith(
        "/" + certificate["metadata"]["name"]
    )
    assert "caBundle" not in configuration["webhooks"][0]["clientConfig"]
    assert certificate["spec"]["secretName"].endswith("-webhook-tls") and not by_kind(objects, "Secret")
    assert one(objects, "Issuer")["spec"] == {"selfSigned": {}}
    own = render(*ON, "--set", "webhook.certManager.enabled=true", "--set", "webhook.certManager.issuerRef.name=corp")
    assert one(own, "Certificate")["spec"]["issuerRef"] == {"name": "corp"} and not by_kind(own, "Issuer")


def test_webhook_rbac_reads_namespaces_and_annotates_jobs(render):
    granted = {
        (group, resource, verb)
        for rule in one(render(*ON), "ClusterRole")["rules"]
        for group in rule["apiGroups"]
        for resource in rule["resources"]
        for verb in rule["verbs"]
    }
    assert {("batch", "jobs", "get"), ("batch", "jobs", "patch"), ("", "namespaces", "get")} <= granted
    assert ("", "secrets", "create") in granted, "the group's token Secret"


def test_webhook_rbac_grants_the_restart_levers_exactly_what_they_call(render):
    """kinds/restart_*.py: an Indexed Job or a TrainJob suspended and resumed (patch; the resuming handler
    watches them), a JobSet's child Job failed (patch), a Volcano Job's Command RestartJob (create only)."""

    def verbs(objects: list[dict], group: str, resource: str) -> set[str]:
        rules = one(objects, "ClusterRole")["rules"]
        return {v for r in rules if group in r["apiGroups"] and resource in r["resources"] for v in r["verbs"]}

    on = render(*ON)
    assert verbs(on, "batch", "jobs") == {"get", "list", "watch", "patch"}
    assert verbs(on, "jobset.x-k8s.io", "jobsets") == {"get", "patch"}
    assert verbs(on, "batch.volcano.sh", "jobs") == {"get", "patch"}
    assert verbs(on, "bus.volcano.sh", "commands") == {"create"}
    assert verbs(on, "trainer.kubeflow.org", "trainjobs") == {"get", "list", "watch", "patch"}
    assert verbs(on, "trainer.kubeflow.org", "clustertrainingruntimes") == {"get"}, "a TrainJob's size, by name"
    assert verbs(on, "trainer.kubeflow.org", "trainingruntimes") == {"get"}
    assert not verbs(render(), "batch", "jobs") and not verbs(render(), "bus.volcano.sh", "commands")
    assert not verbs(render(), "trainer.kubeflow.org", "trainjobs")


def test_webhook_rbac_reads_annotates_and_suspends_pytorchjobs_and_nothing_else_of_kubeflow(render):
    """get (its size), patch (the diagnosis, the suspend toggle), list and watch (the handler resuming the
    PyTorchJobs rankwatch suspended); no create or delete, no other kubeflow.org resource."""
    rules = one(render(*ON), "ClusterRole")["rules"]
    granted = {
        (res, v) for r in rules if "kubeflow.org" in r["apiGroups"] for res in r["resources"] for v in r["verbs"]
    }
    assert granted == {("pytorchjobs", verb) for verb in ("get", "list", "watch", "patch")}
    off = one(render(), "ClusterRole")["rules"]
    assert not [r for r in off if "kubeflow.org" in r["apiGroups"]], "only with the webhook on"
