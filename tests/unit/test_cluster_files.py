"""Local-cluster files that need no running cluster: certificates, kubeconfigs, state."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from cryptography import x509
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from rankwatch.cluster import kubeconfig, pki
from rankwatch.cluster.state import ClusterError, ClusterState


@pytest.fixture(scope="module")
def pki_dir(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("pki")
    pki.generate(directory)
    return directory


def load(path: Path) -> x509.Certificate:
    return x509.load_pem_x509_certificate(path.read_bytes())


def test_every_certificate_is_signed_by_the_cluster_ca(pki_dir: Path):
    ca = load(pki_dir / "ca.crt")
    for stem in ["apiserver", "etcd-server", "apiserver-etcd-client", *(client.stem for client in pki.CLIENTS)]:
        cert = load(pki_dir / f"{stem}.crt")
        cert.verify_directly_issued_by(ca)


def test_an_identity_added_to_an_existing_cluster_is_a_client_of_its_ca_with_no_group(pki_dir: Path):
    from rankwatch.cluster.monitoring import PROMETHEUS_IDENTITY

    pki.issue_client(pki_dir, PROMETHEUS_IDENTITY)
    cert = load(pki_dir / "prometheus.crt")
    cert.verify_directly_issued_by(load(pki_dir / "ca.crt"))
    assert cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value == PROMETHEUS_IDENTITY.user
    assert not cert.subject.get_attributes_for_oid(NameOID.ORGANIZATION_NAME)  # RBAC grants it pods get/list/watch
    assert (pki_dir / "prometheus.key").stat().st_mode & 0o077 == 0


def test_every_wrapper_module_requires_the_pinned_version_of_what_it_builds():
    import re

    from rankwatch.cluster.versions import ADMISSION, COMPONENTS, MONITORING, TOOLS

    for component in (*COMPONENTS, *TOOLS, *MONITORING, *ADMISSION):
        assert (component.module_dir / "go.sum").exists(), component.name
        gomod = (component.module_dir / "go.mod").read_text()
        required = dict(re.findall(r"^(?:require\s+|\t)(\S+) (v\S+)", gomod, re.MULTILINE))
        for package in component.packages.values():
            module = max((m for m in required if package == m or package.startswith(m + "/")), key=len)
            assert required[module] == component.version, (component.name, module, required[module])


def test_client_identities_carry_user_and_groups(pki_dir: Path):
    admin = load(pki_dir / "admin.crt")
    assert admin.subject.get_attributes_for_oid(NameOID.ORGANIZATION_NAME)[0].value == "system:masters"
    scheduler = load(pki_dir / "scheduler.crt")
    assert scheduler.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value == "system:kube-scheduler"
    assert not scheduler.subject.get_attributes_for_oid(NameOID.ORGANIZATION_NAME)
    usage = scheduler.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert list(usage) == [ExtendedKeyUsageOID.CLIENT_AUTH]


def test_serving_certificate_names_loopback_and_the_service(pki_dir: Path):
    sans = load(pki_dir / "apiserver.crt").extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert "kubernetes.default.svc" in sans.get_values_for_type(x509.DNSName)
    assert "127.0.0.1" in {str(ip) for ip in sans.get_values_for_type(x509.IPAddress)}


def test_private_keys_are_owner_only(pki_dir: Path):
    for key in pki_dir.glob("*.key"):
        assert key.stat().st_mode & 0o077 == 0, key


def test_kubeconfig_embeds_credentials_and_is_owner_only(pki_dir: Path, tmp_path: Path):
    path = kubeconfig.write(tmp_path / "kc", "https://127.0.0.1:6443", pki_dir, "admin")
    config = yaml.safe_load(path.read_text())
    assert config["clusters"][0]["cluster"]["server"] == "https://127.0.0.1:6443"
    assert config["users"][0]["user"]["client-key-data"]
    assert path.stat().st_mode & 0o777 == 0o600


def test_state_round_trips_and_corruption_is_reported(tmp_path: Path):
    path = tmp_path / "state.json"
    ClusterState(ports={"etcd": 1234}, pids={"etcd": 42}, nodes=3).save(path)
    assert ClusterState.load(path) == ClusterState(ports={"etcd": 1234}, pids={"etcd": 42}, nodes=3)
    assert ClusterState.load(tmp_path / "absent.json") is None
    path.write_text("{not json")
    with pytest.raises(ClusterError, match="is not a cluster state file"):
        ClusterState.load(path)
