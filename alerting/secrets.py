"""Credentials for receivers: read from Kubernetes Secrets, held so they cannot leak by accident.

The routing config names a Secret and a key (``{secretKeyRef: {name, key}}``); a resolver turns that
into the value once, at load. ``Secret`` prints as its source only, so a receiver, a config or an
exception message that includes one shows ``Secret(rankwatch-feishu/signing-secret)``, never the
value; code that needs the value calls ``reveal()`` at the last moment.
"""

from __future__ import annotations

import base64
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

SecretResolver = Callable[[str, str], str]
"""(Secret name, key) -> value. Raises ``KeyError`` (or ``LookupError``) when absent."""


class Secret:
    __slots__ = ("_value", "source")

    def __init__(self, value: str, source: str) -> None:
        self._value = value
        self.source = source

    def reveal(self) -> str:
        return self._value

    def __repr__(self) -> str:
        return f"Secret({self.source})"

    __str__ = __repr__

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Secret) and other.source == self.source and other._value == self._value

    def __hash__(self) -> int:
        return hash(self.source)

    def __reduce__(self) -> tuple:
        raise TypeError("a Secret is not serialisable")


def kubernetes_resolver(namespace: str, kube: Any) -> SecretResolver:
    """Read keys of Secrets in ``namespace`` through ``kube`` (a ``kubernetes.client.ApiClient``; the
    operator's ServiceAccount needs ``get`` on them)."""
    import kubernetes
    from kubernetes.client.exceptions import ApiException

    cache: dict[str, Mapping[str, str]] = {}

    def resolve(name: str, key: str) -> str:
        if name not in cache:
            try:
                secret = kubernetes.client.CoreV1Api(kube).read_namespaced_secret(name, namespace)
            except ApiException as error:
                # Only status and reason: the response body of a Secret read is not ours to print.
                raise LookupError(
                    f"cannot read Secret {namespace}/{name}: HTTP {error.status} {error.reason}"
                ) from None
            cache[name] = secret.data or {}
        data = cache[name]
        if key not in data:
            raise LookupError(f"Secret {namespace}/{name} has no key {key!r} (keys: {', '.join(sorted(data))})")
        return base64.b64decode(data[key]).decode()

    return resolve


def file_resolver(path: str | Path) -> SecretResolver:
    """Secrets from a local YAML file ``{secret-name: {key: value}}``: the CLI outside a cluster, tests."""
    import yaml

    data = yaml.safe_load(Path(path).read_text()) or {}
    return mapping_resolver(data, origin=str(path))


def mapping_resolver(data: Mapping[str, Mapping[str, str]], origin: str = "secrets") -> SecretResolver:
    def resolve(name: str, key: str) -> str:
        try:
            return str(data[name][key])
        except (KeyError, TypeError):
            raise LookupError(f"{origin} has no Secret {name!r} with key {key!r}") from None

    return resolve
