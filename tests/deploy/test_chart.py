"""The Helm chart: lint, render, and what the rendered objects promise (RBAC, leader election, secrets by name,
monitoring objects only where the Prometheus Operator exists, a dashboard with the agreed panels)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import yaml
from chart_support import CHART, REPO, RULES, by_kind, one

from rankwatch.alerting import intake
from rankwatch.alerting.config import parse_config
from rankwatch.operator.lifecycle import pod_spec

MONITORING = ("--api-versions", "monitoring.coreos.com/v1")


def test_helm_lint_passes_strictly(helm):
    result = helm("lint", "--strict", str(CHART))
    assert "0 chart(s) failed" in result.stdout


def test_chart_crd_is_the_repository_crd():
    source = REPO / "crds" / "trainingjobs.rankwatch.io.yaml"
    copy = CHART / "crds" / source.name
    assert copy.read_bytes() == source.read_bytes(), f"refresh the chart's copy: cp {source} {copy}"


def test_chart_crds_are_rankwatchs_own():
    crds = [doc for path in (CHART / "crds").glob("*.yaml") for doc in yaml.safe_load_all(path.read_text()) if doc]
    assert {crd["metadata"]["name"] for crd in crds} == {"trainingjobs.rankwatch.io"}


def test_without_prometheus_operator_no_monitoring_objects(render):
    kinds = {o["kind"] for o in render()}
    assert not {"ServiceMonitor", "PodMonitor", "PrometheusRule"} & kinds
    assert {"Deployment", "ServiceAccount", "ClusterRole", "ClusterRoleBinding", "Service", "ConfigMap"} <= kinds


def test_with_prometheus_operator_servicemonitor_and_all_rule_groups(render):
    objects = render(*MONITORING)
    monitor = one(objects, "ServiceMonitor")
    assert monitor["spec"]["endpoints"][0]["port"] == "metrics"
    assert {"targetLabel": "job", "replacement": "rankwatch-operator"} in monitor["spec"]["endpoints"][0]["relabelings"]
    metrics_service = one(objects, "Service", "-metrics")
    assert all(
        metrics_service["metadata"]["labels"][k] == v for k, v in monitor["spec"]["selector"]["matchLabels"].items()
    )
    rule = one(objects, "PrometheusRule")
    assert rule["spec"]["groups"] == yaml.safe_load(RULES.read_text())["groups"]  # the file, unaltered


def test_with_prometheus_operator_a_podmonitor_scrapes_the_injected_sidecars(render):
    from rankwatch.operator import api
    from rankwatch.operator.lifecycle.pod_spec import SIDECAR_METRICS_PORT_NAME

    monitor = one(render(*MONITORING), "PodMonitor")
    assert monitor["spec"]["namespaceSelector"] == {"any": True}
    assert monitor["spec"]["selector"]["matchExpressions"] == [{"key": api.JOB_NAME_LABEL, "operator": "Exists"}]
    (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
    assert endpoint["port"] == SIDECAR_METRICS_PORT_NAME  # the port the operator injects
    assert {"targetLabel": "job", "replacement": "rankwatch-sidecar"} in endpoint["relabelings"]
    assert {"sourceLabels": ["__meta_kubernetes_pod_label_rankwatch_io_job_name"], "targetLabel": "trainingjob"} in (
        endpoint["relabelings"]
    )


def test_rule_groups_can_be_switched_off(render):
    rule = one(render(*MONITORING, "--set", "prometheusRule.groups.rankwatch-gpu=false"), "PrometheusRule")
    assert "rankwatch-gpu" not in [g["name"] for g in rule["spec"]["groups"]]
    assert "rankwatch-node" in [g["name"] for g in rule["spec"]["groups"]]


def test_operator_runs_two_non_root_replicas_of_which_only_the_leader_is_ready(render):
    objects = render(release="rw", namespace="ops")
    deployment = one(objects, "Deployment")
    spec = deployment["spec"]["template"]["spec"]
    (container,) = spec["containers"]
    assert deployment["spec"]["replicas"] == 2
    assert container["args"] == ["rankwatch", "operator"]
    assert container["image"] == "rankwatch/rankwatch:0.1.0"
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert (env["RANKWATCH_LEASE_NAME"], env["RANKWATCH_LEASE_NAMESPACE"]) == ("rw-rankwatch-operator", "ops")
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert env["RANKWATCH_PROBE_LISTEN"] == f"0.0.0.0:{ports['health']}"
    assert container["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "health"}
    assert container["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "health"}
    # A rollout cannot wait for a standby to become ready: it never does.
    assert deployment["spec"]["strategy"]["rollingUpdate"]["maxUnavailable"] == "100%"
    assert spec["securityContext"]["runAsNonRoot"] is True
    assert spec["securityContext"]["runAsUser"] == pod_spec._restricted_security_context()["runAsUser"]
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    assert not [v for v in spec["volumes"] if "persistentVolumeClaim" in v], "the alert store is in the API server"
    assert not by_kind(objects, "ClusterKopfPeering") and not by_kind(objects, "KopfPeering")


def test_the_lease_and_the_alert_store_are_granted_in_the_release_namespace_only(render):
    objects = render(release="rw", namespace="ops")
    role = one(objects, "Role")
    assert role["metadata"]["namespace"] == "ops"
    assert {"apiGroups": ["coordination.k8s.io"], "resources": ["leases"], "verbs": ["get", "create", "update"]} in (
        role["rules"]
    )
    binding = one(objects, "RoleBinding")
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
    assert binding["subjects"][0]["name"] == one(objects, "ServiceAccount")["metadata"]["name"]
    config = yaml.safe_load(
        one(render("--set", "alerting.enabled=true", release="rw", namespace="ops"), "ConfigMap", "-alerting")["data"][
            "alerting.yaml"
        ]
    )
    assert config["store"]["configMap"] and "path" not in config["store"]


def test_namespaced_operator_may_list_namespaces(render):
    objects = render("--set", "operator.namespaces={team-a,ml-*}")
    args = one(objects, "Deployment")["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--namespace=team-a" in args and "--namespace=ml-*" in args
    rules = one(objects, "ClusterRole")["rules"]
    assert {"apiGroups": [""], "resources": ["namespaces"], "verbs": ["list", "watch"]} in rules


def test_operator_env_points_sidecars_at_the_collector_service(render):
    objects = render(release="rw", namespace="ops")
    env = {
        e["name"]: e.get("value")
        for e in one(objects, "Deployment")["spec"]["template"]["spec"]["containers"][0]["env"]
    }
    collector = one(objects, "Service", "-collector")
    port = collector["spec"]["ports"][0]["port"]
    assert env["RANKWATCH_COLLECTOR_URL"] == f"http://{collector['metadata']['name']}.ops.svc:{port}"
    assert env["RANKWATCH_IMAGE"] == "rankwatch/rankwatch:0.1.0"
    assert "RANKWATCH_ALERTING_CONFIG" not in env, "alerting is off by default"
    enabled = one(render("--set", "alerting.enabled=true"), "Deployment")["spec"]["template"]["spec"]["containers"][0]
    env |= {e["name"]: e.get("value") for e in enabled["env"]}
    assert env["RANKWATCH_ALERTING_CONFIG"] == "/etc/rankwatch/alerting/alerting.yaml"
    # Every setting the operator reads is set by the chart.
    config_source = (REPO / "operator" / "config.py").read_text()
    assert set(re.findall(r'"(RANKWATCH_[A-Z_]+)"', config_source)) <= set(env)


def test_alerting_is_off_by_default_and_needs_no_secret(render):
    objects = render()
    assert not [c for c in by_kind(objects, "ConfigMap") if c["metadata"]["name"].endswith("-alerting")]
    pod = one(objects, "Deployment")["spec"]["template"]["spec"]
    assert not [v for v in pod["volumes"] if v["name"] == "alerting-config"]
    assert not [m for m in pod["containers"][0]["volumeMounts"] if m["name"] == "alerting-config"]
    # `--set alerting.config=null` with alerting off renders too (it used to be the only way to try).
    assert one(render("--set", "alerting.config=null"), "Deployment")


def test_services_reach_the_operators_http_port(render):
    objects = render()
    container = one(objects, "Deployment")["spec"]["template"]["spec"]["containers"][0]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["RANKWATCH_COLLECTOR_LISTEN"] == f"0.0.0.0:{ports['http']}"
    for service in by_kind(objects, "Service"):
        (port,) = service["spec"]["ports"]
        assert port["targetPort"] == ("metrics" if service["metadata"]["name"].endswith("-metrics") else "http")
    assert {s["metadata"]["name"].rsplit("-", 1)[1] for s in by_kind(objects, "Service")} == {
        "collector",
        "intake",
        "metrics",
    }


def test_alerting_config_is_valid_and_references_secrets_only_by_name(render):
    config_map = one(render("--set", "alerting.enabled=true"), "ConfigMap", "-alerting")
    data = yaml.safe_load(config_map["data"]["alerting.yaml"])
    asked: list[tuple[str, str]] = []

    def resolver(name: str, key: str) -> str:
        asked.append((name, key))
        return "https://open.feishu.cn/open-apis/bot/v2/hook/x" if key == "webhook-url" else "value"

    parse_config(data, resolver)  # the operator's own loader accepts it
    assert set(asked) == {
        ("rankwatch-feishu", "webhook-url"),
        ("rankwatch-feishu", "signing-secret"),
        ("rankwatch-intake", "token"),
    }
    assert not by_kind(render(), "Secret"), "the chart must never carry credentials"


def test_existing_alerting_configmap_replaces_the_rendered_one(render):
    objects = render("--set", "alerting.enabled=true", "--set", "alerting.existingConfigMap=my-alerting")
    assert not [c for c in by_kind(objects, "ConfigMap") if c["metadata"]["name"].endswith("-alerting")]
    volumes = one(objects, "Deployment")["spec"]["template"]["spec"]["volumes"]
    assert {"name": "alerting-config", "configMap": {"name": "my-alerting"}} in volumes


def test_rbac_grants_exactly_the_operators_verbs(render):
    rules = one(render(), "ClusterRole")["rules"]
    granted = {
        (group, resource, verb)
        for r in rules
        for group in r["apiGroups"]
        for resource in r["resources"]
        for verb in r["verbs"]
    }
    assert ("", "secrets", "list") not in granted and ("", "secrets", "watch") not in granted
    assert not any("*" in item for item in granted)
    assert ("rankwatch.io", "trainingjobs/status", "patch") in granted
    assert ("", "nodes", "patch") in granted
    deleting = {item for item in granted if item[2] == "delete"}
    assert deleting == {("", "pods", "delete")}, "recovery ends a hung attempt's pods; nothing else is deleted"
    assert not any(verb in {"deletecollection", "update", "escalate", "bind", "impersonate"} for *_, verb in granted)


def test_dashboard_configmap_has_the_agreed_panels(render):
    config_map = one(render(), "ConfigMap", "-dashboard")
    assert config_map["metadata"]["labels"]["grafana_dashboard"] == "1"
    dashboard = json.loads(config_map["data"]["rankwatch.json"])
    titles = {p["title"] for p in dashboard["panels"]}
    assert {
        "Jobs by phase",
        "Jobs by health",
        "Per-rank wait time in NCCL",
        "Step time",
        "Detections",
        "Cordoned nodes",
        "Alerts by level",
    } <= titles
    assert all(t["expr"] for p in dashboard["panels"] for t in p["targets"])


def test_alertmanager_example_posts_to_the_intake_route(render):
    example = yaml.safe_load((CHART / "examples" / "alertmanager-config.yaml").read_text())
    (webhook,) = next(r for r in example["receivers"] if r["name"] == "rankwatch-intake")["webhook_configs"]
    assert webhook["url"].endswith(f":8081{intake.PREFIX}/alertmanager")
    intake_service = one(render(release="release", namespace="namespace"), "Service", "-intake")
    url = webhook["url"].replace("RELEASE", "release").replace("NAMESPACE", "namespace")
    assert url.startswith(f"http://{intake_service['metadata']['name']}.namespace.svc:")
    # rankwatch's own alerts must not be routed back into the path they watch over.
    first = example["route"]["routes"][0]
    assert first["receiver"] != "rankwatch-intake" and first["matchers"] == ['component="rankwatch"']


def test_rendered_chart_has_no_inlined_credentials(render):
    text = json.dumps(render(*MONITORING))
    assert not re.search(r"open-apis/bot/v2/hook/[A-Za-z0-9-]{8,}", text)
    assert 'app_secret": "' not in text


def test_library_path_in_image_matches_the_dockerfile():
    dockerfile = (REPO / "Dockerfile").read_text()
    assert pod_spec.LIBRARY_IN_IMAGE in dockerfile
    assert Path(pod_spec.LIBRARY_IN_IMAGE).name == "librankwatch-nccl.so"


def _grants(rules: list[dict]) -> set[tuple[str, str, str]]:
    return {(g, res, verb) for r in rules for g in r["apiGroups"] for res in r["resources"] for verb in r["verbs"]}


NAMESPACED = ("pods", "services", "secrets", "configmaps")
"""What the operator may touch only in the namespaces it watches, when they are listed."""


def test_listed_namespaces_keep_pods_services_secrets_and_configmaps_out_of_the_cluster_role(render):
    """With the watched namespaces named, the operator creates and deletes pods and reads Secrets only
    there (and Secrets in its own namespace, for the alerting Secrets), never cluster-wide: not in
    kube-system, not in another team's namespace."""
    objects = render("--set", "operator.namespaces={team-a,team-b}", release="rw", namespace="ops")
    cluster = _grants(one(objects, "ClusterRole")["rules"])
    assert not {item for item in cluster if item[1] in NAMESPACED}
    assert [b["roleRef"]["kind"] for b in by_kind(objects, "ClusterRoleBinding")] == ["ClusterRole"]
    roles = {role["metadata"]["namespace"]: _grants(role["rules"]) for role in by_kind(objects, "Role")}
    assert set(roles) == {"ops", "team-a", "team-b"}
    for namespace in ("team-a", "team-b"):
        assert {item for item in roles[namespace] if item[1] == "secrets"} == {("", "secrets", "get"),
                                                                              ("", "secrets", "create")}  # fmt: skip
    assert {item for item in roles["ops"] if item[1] == "secrets"} == {("", "secrets", "get")}
    everything = _grants(one(render(release="rw", namespace="ops"), "ClusterRole")["rules"])
    assert everything - {item for item in everything if item[1] in NAMESPACED} <= cluster, (
        "only pods, Services, Secrets and ConfigMaps move into the namespaces' Roles"
    )
    for namespace in ("team-a", "team-b"):
        assert {item for item in everything if item[1] in NAMESPACED} <= roles[namespace]
        assert ("", "pods", "delete") in roles[namespace]
    bindings = {b["metadata"]["namespace"]: b for b in by_kind(objects, "RoleBinding")}
    assert set(bindings) == {"ops", "team-a", "team-b"}
    account = one(objects, "ServiceAccount")["metadata"]["name"]
    assert all(b["subjects"] == [{"kind": "ServiceAccount", "name": account, "namespace": "ops"}]
               for b in bindings.values())  # fmt: skip


def test_every_namespace_or_globs_get_secrets_by_name_only(render):
    for args in ((), ("--set", "operator.namespaces={team-a,ml-*}")):
        cluster = _grants(one(render(*args), "ClusterRole")["rules"])
        assert {item for item in cluster if item[1] == "secrets"} == {("", "secrets", "get"), ("", "secrets", "create")}
        assert [role["metadata"]["namespace"] for role in by_kind(render(*args), "Role")] == ["rankwatch-system"]


def _policies(objects: list[dict]) -> dict[str, dict]:
    return {p["spec"]["policyTypes"][0]: p for p in by_kind(objects, "NetworkPolicy")}


SIDECARS = {"podSelector": {"matchLabels": {"app.kubernetes.io/managed-by": "rankwatch"}, "matchExpressions": [
    {"key": "rankwatch.io/job-name", "operator": "Exists"}]}}  # fmt: skip
"""The jobs' worker pods as a peer: labelled by rankwatch (a template's values for them are overwritten)."""
INJECTED = {"podSelector": {"matchLabels": {"rankwatch.io/traced": "true"}}}
"""Any pod carrying the sidecar, pods of other kinds included: the webhook labels those it injects."""


def test_a_network_policy_limits_who_reaches_the_collector_and_who_reads_metrics(render):
    objects = render(release="rw", namespace="ops")
    policy = _policies(objects)["Ingress"]
    deployment = one(objects, "Deployment")
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert policy["metadata"]["namespace"] == "ops"
    assert policy["spec"]["podSelector"]["matchLabels"].items() <= pod_labels.items()
    by_port = {rule["ports"][0]["port"]: rule.get("from") for rule in policy["spec"]["ingress"]}
    assert set(by_port) == {"http", "metrics", "health"}
    assert by_port["health"] is None, "the kubelet's probes come from the node"
    assert {"namespaceSelector": {}, **SIDECARS} in by_port["http"]
    assert all(peer.get("namespaceSelector") for peer in by_port["metrics"]), "no job pod reads /metrics"
    assert not [peer for peer in by_port["metrics"] if "podSelector" in peer and peer.get("namespaceSelector") == {}]
    assert not by_kind(render("--set", "networkPolicy.enabled=false"), "NetworkPolicy")


def test_with_listed_namespaces_only_their_pods_reach_the_collector(render):
    objects = render("--set", "operator.namespaces={team-a,team-b}", release="rw", namespace="ops")
    by_port = {r["ports"][0]["port"]: r.get("from") for r in _policies(objects)["Ingress"]["spec"]["ingress"]}
    listed = {"matchExpressions": [{"key": "kubernetes.io/metadata.name", "operator": "In",
                                    "values": ["team-a", "team-b"]}]}  # fmt: skip
    assert {"namespaceSelector": listed, **SIDECARS} in by_port["http"]
    assert not [peer for peer in by_port["http"] if peer.get("namespaceSelector") == {}]


def test_metrics_have_a_port_of_their_own_behind_the_metrics_service(render):
    objects = render(release="rw", namespace="ops")
    container = one(objects, "Deployment")["spec"]["template"]["spec"]["containers"][0]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["RANKWATCH_METRICS_LISTEN"] == f"0.0.0.0:{ports['metrics']}"
    assert ports["metrics"] != ports["http"]
    targets = {
        s["metadata"]["name"].rsplit("-", 1)[1]: s["spec"]["ports"][0]["targetPort"]
        for s in by_kind(objects, "Service")
    }
    assert targets == {"collector": "http", "intake": "http", "metrics": "metrics"}


def test_an_egress_policy_lets_the_operator_reach_only_what_it_needs(render):
    objects = render(release="rw", namespace="ops")
    egress = _policies(objects)["Egress"]["spec"]["egress"]
    ports = [{(p["port"], p.get("protocol", "TCP")) for p in rule["ports"]} for rule in egress]
    assert all(rule.get("ports") for rule in egress), "no rule opens every port"
    assert {(53, "UDP"), (53, "TCP")} in ports and {(443, "TCP"), (6443, "TCP")} in ports
    sidecar_port = 9400  # values.yaml sidecar.metricsPort
    [sidecars] = [
        rule
        for rule in egress
        if {(sidecar_port, "TCP")} == {(p["port"], p.get("protocol", "TCP")) for p in rule["ports"]}
    ]
    assert sidecars["to"] == [{"namespaceSelector": {}, **SIDECARS}, {"namespaceSelector": {}, **INJECTED}]
    assert len(_policies(render("--set", "networkPolicy.egress.enabled=false"))) == 1


def test_archive_endpoints_come_from_the_values_and_none_by_default(render):
    def env(*args: str) -> dict[str, str]:
        container = one(render(*args), "Deployment")["spec"]["template"]["spec"]["containers"][0]
        return {e["name"]: e.get("value") for e in container["env"]}

    assert env()["RANKWATCH_ARCHIVE_ENDPOINTS"] == ""
    listed = env("--set", "operator.archive.endpoints={http://minio.storage.svc:9000,https://s3.example.com}")
    assert listed["RANKWATCH_ARCHIVE_ENDPOINTS"] == "http://minio.storage.svc:9000,https://s3.example.com"


def test_the_sidecar_endpoint_annotation_is_trusted_for_no_host_by_default(render):
    container = one(render(), "Deployment")["spec"]["template"]["spec"]["containers"][0]
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["RANKWATCH_SIDECAR_ENDPOINT_HOSTS"] == ""
    local = one(render("--set", "operator.sidecarEndpointHosts={127.0.0.1}"), "Deployment")
    env = {e["name"]: e.get("value") for e in local["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env["RANKWATCH_SIDECAR_ENDPOINT_HOSTS"] == "127.0.0.1"


def test_pull_secrets_for_the_workers_rankwatch_image_reach_the_operator(render):
    env = {
        e["name"]: e.get("value")
        for e in one(render("--set", "sidecar.imagePullSecrets={regcred,mirror}"), "Deployment")["spec"]["template"][
            "spec"
        ]["containers"][0]["env"]
    }
    assert env["RANKWATCH_IMAGE_PULL_SECRETS"] == "regcred,mirror"


def _checksum(objects: list[dict]) -> str:
    return one(objects, "Deployment")["spec"]["template"]["metadata"]["annotations"]["checksum/alerting"]


def test_an_alerting_config_change_rolls_the_operator_pods(render):
    """The operator reads its alerting config once, at start: a new config must give the Deployment a new
    pod template (so new pods), and the same config the same one (no needless restart)."""
    on = ("--set", "alerting.enabled=true")
    base = _checksum(render(*on))
    assert _checksum(render(*on)) == base
    assert _checksum(render(*on, "--set", "alerting.config.route.group_wait=45s")) != base
    assert _checksum(render()) != base, "turning alerting off"
    mine = _checksum(render(*on, "--set", "alerting.existingConfigMap=mine"))
    assert mine != base and mine != _checksum(render(*on, "--set", "alerting.existingConfigMap=theirs"))
    # Its data is hashed where Helm can read the cluster (install, upgrade, --dry-run=server): the e2e
    # test_chart_config_rollout.py.


def test_the_admin_may_refuse_jobs_sys_ptrace_for_their_sidecars(render):
    def env(*args: str) -> dict[str, str]:
        container = one(render(*args), "Deployment")["spec"]["template"]["spec"]["containers"][0]
        return {e["name"]: e.get("value") for e in container["env"]}

    assert env()["RANKWATCH_SIDECAR_ALLOW_PTRACE"] == "true"
    assert env("--set", "sidecar.allowPtrace=false")["RANKWATCH_SIDECAR_ALLOW_PTRACE"] == "false"


def test_pods_of_other_kinds_that_the_webhook_injected_reach_the_collector_and_are_reached(render):
    """An Indexed Job's pod has no rankwatch.io/job-name: the webhook labels it rankwatch.io/traced, and both
    policies take that label, within the listed namespaces when they are listed."""
    from rankwatch.operator import api

    for args, namespaces in ((), {}), (("--set", "operator.namespaces={team-a}"), {"matchExpressions": [
            {"key": "kubernetes.io/metadata.name", "operator": "In", "values": ["team-a"]}]}):  # fmt: skip
        policies = _policies(render(*args))
        peer = {"namespaceSelector": namespaces, "podSelector": {"matchLabels": {api.TRACED_LABEL: "true"}}}
        [http] = [r for r in policies["Ingress"]["spec"]["ingress"] if r["ports"][0]["port"] == "http"]
        assert peer in http["from"]
        [sidecars] = [r for r in policies["Egress"]["spec"]["egress"] if r["ports"][0]["port"] == 9400]
        assert peer in sidecars["to"]
