"""Certificates and keys for the local control plane: one CA, a serving cert, client certs.

Every identity is a client certificate signed by the cluster CA; RBAC sees the certificate's CN as
the user and its O fields as groups, so the controller-manager and scheduler get exactly the
built-in roles Kubernetes grants them.
"""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

VALIDITY = datetime.timedelta(days=365)


@dataclass(frozen=True)
class ClientIdentity:
    """A user of the API server: file stem, user name (CN) and groups (O)."""

    stem: str
    user: str
    groups: tuple[str, ...] = ()


CLIENTS = (
    ClientIdentity("admin", "rankwatch-admin", ("system:masters",)),
    ClientIdentity("controller-manager", "system:kube-controller-manager"),
    ClientIdentity("scheduler", "system:kube-scheduler"),
    # kwok acts as the kubelet of every fake node; system:masters keeps it simple and it never
    # leaves loopback.
    ClientIdentity("kwok", "kwok-controller", ("system:masters",)),
)


def _write_key(path: Path, key: ec.EllipticCurvePrivateKey | rsa.RSAPrivateKey) -> None:
    path.write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    path.chmod(0o600)


def _write_cert(path: Path, cert: x509.Certificate) -> None:
    path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))


def _name(common_name: str, organizations: tuple[str, ...] = ()) -> x509.Name:
    attributes = [x509.NameAttribute(NameOID.ORGANIZATION_NAME, org) for org in organizations]
    attributes.append(x509.NameAttribute(NameOID.COMMON_NAME, common_name))
    return x509.Name(attributes)


def _builder(subject: x509.Name, issuer: x509.Name, public_key) -> x509.CertificateBuilder:
    now = datetime.datetime.now(datetime.UTC)
    return (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer)
        .public_key(public_key)
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + VALIDITY)
    )


def _leaf(
    ca_key: ec.EllipticCurvePrivateKey,
    ca_cert: x509.Certificate,
    subject: x509.Name,
    usage: x509.ObjectIdentifier | list[x509.ObjectIdentifier],
    sans: list[x509.GeneralName] | None = None,
) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
    key = ec.generate_private_key(ec.SECP256R1())
    builder = (
        _builder(subject, ca_cert.subject, key.public_key())
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage(usage if isinstance(usage, list) else [usage]), critical=False)
    )
    if sans:
        builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
    return key, builder.sign(ca_key, hashes.SHA256())


def generate(directory: Path) -> None:
    """Write ca, apiserver, etcd-server, apiserver-etcd-client and per-client {stem} .crt/.key, sa.{key,pub}."""
    directory.mkdir(parents=True, exist_ok=True)
    directory.chmod(0o700)

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_subject = _name("rankwatch-local-ca")
    ca_cert = (
        _builder(ca_subject, ca_subject, ca_key.public_key())
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .sign(ca_key, hashes.SHA256())
    )
    _write_key(directory / "ca.key", ca_key)
    _write_cert(directory / "ca.crt", ca_cert)

    sans: list[x509.GeneralName] = [
        x509.DNSName("localhost"),
        x509.DNSName("kubernetes"),
        x509.DNSName("kubernetes.default"),
        x509.DNSName("kubernetes.default.svc"),
        x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
        x509.IPAddress(ipaddress.ip_address("10.0.0.1")),  # first address of the service range
    ]
    key, cert = _leaf(ca_key, ca_cert, _name("kube-apiserver"), ExtendedKeyUsageOID.SERVER_AUTH, sans)
    _write_key(directory / "apiserver.key", key)
    _write_cert(directory / "apiserver.crt", cert)

    # etcd serves TLS and accepts only clients with a certificate of this CA (the API server's). Its
    # own certificate is also a client one: etcd's gRPC gateway dials the server with it (as kubeadm's).
    etcd_sans: list[x509.GeneralName] = [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
    usages = [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
    key, cert = _leaf(ca_key, ca_cert, _name("etcd"), usages, etcd_sans)
    _write_key(directory / "etcd-server.key", key)
    _write_cert(directory / "etcd-server.crt", cert)
    key, cert = _leaf(ca_key, ca_cert, _name("kube-apiserver-etcd-client"), ExtendedKeyUsageOID.CLIENT_AUTH)
    _write_key(directory / "apiserver-etcd-client.key", key)
    _write_cert(directory / "apiserver-etcd-client.crt", cert)

    for client in CLIENTS:
        key, cert = _leaf(ca_key, ca_cert, _name(client.user, client.groups), ExtendedKeyUsageOID.CLIENT_AUTH)
        _write_key(directory / f"{client.stem}.key", key)
        _write_cert(directory / f"{client.stem}.crt", cert)

    # Service-account tokens are signed with RSA by default; keep a dedicated key pair.
    sa_key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    _write_key(directory / "sa.key", sa_key)
    (directory / "sa.pub").write_bytes(
        sa_key.public_key().public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
    )


def issue_client(directory: Path, client: ClientIdentity) -> None:
    """Write ``{stem}.crt``/``.key`` for ``client``, signed by the cluster's existing CA (for identities
    added after the cluster was made, such as the local Prometheus')."""
    ca_key = serialization.load_pem_private_key((directory / "ca.key").read_bytes(), password=None)
    ca_cert = x509.load_pem_x509_certificate((directory / "ca.crt").read_bytes())
    assert isinstance(ca_key, ec.EllipticCurvePrivateKey)
    key, cert = _leaf(ca_key, ca_cert, _name(client.user, client.groups), ExtendedKeyUsageOID.CLIENT_AUTH)
    _write_key(directory / f"{client.stem}.key", key)
    _write_cert(directory / f"{client.stem}.crt", cert)


def issue_serving(directory: Path, hosts: list[str]) -> None:
    """Write ``tls.crt``/``tls.key`` serving ``hosts`` (names or IP addresses), signed by the CA in
    ``directory`` (``ca.crt``/``ca.key``, made here if absent): a webhook server's certificate."""
    directory.mkdir(parents=True, exist_ok=True)
    if not (directory / "ca.key").exists():
        ca_key = ec.generate_private_key(ec.SECP256R1())
        subject = _name("rankwatch-webhook-ca")
        ca_cert = (
            _builder(subject, subject, ca_key.public_key())
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(ca_key, hashes.SHA256())
        )
        _write_key(directory / "ca.key", ca_key)
        _write_cert(directory / "ca.crt", ca_cert)
    ca_key = serialization.load_pem_private_key((directory / "ca.key").read_bytes(), password=None)
    ca_cert = x509.load_pem_x509_certificate((directory / "ca.crt").read_bytes())
    assert isinstance(ca_key, ec.EllipticCurvePrivateKey)
    sans: list[x509.GeneralName] = []
    for host in hosts:
        try:
            sans.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            sans.append(x509.DNSName(host))
    key, cert = _leaf(ca_key, ca_cert, _name(hosts[0]), ExtendedKeyUsageOID.SERVER_AUTH, sans)
    _write_key(directory / "tls.key", key)
    _write_cert(directory / "tls.crt", cert)
