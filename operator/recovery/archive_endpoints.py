"""Which S3 endpoints a job's ``spec.tracing.archive.s3.endpoint`` may name: the admin's allow-list.

Without it a job chose any ``http(s)://host:port``: the operator sent signed PUTs with the job's
evidence to a host of the job's choosing and told open ports from closed ones (a port scanner from
the operator's position in the network). An endpoint is compared as its origin (scheme, host, port;
the default port spelled out), and must be nothing more: no path, query, fragment or user part.
An unset endpoint is AWS S3 (the client's own endpoint for the region) and is always allowed.
"""

from __future__ import annotations

from urllib.parse import urlsplit

_DEFAULT_PORTS = {"http": 80, "https": 443}


def origin(url: str) -> str:
    """``scheme://host:port`` of an endpoint URL, lower-cased, the port always given; ValueError
    naming what is wrong for anything that is not a bare http(s) origin."""
    try:
        parts = urlsplit(url.strip())
        port = parts.port
    except ValueError as error:
        raise ValueError(f"{url!r} is not a URL ({error})") from None
    if parts.scheme not in _DEFAULT_PORTS or not parts.hostname:
        raise ValueError(f"{url!r} is not an http(s) URL with a host")
    if parts.username is not None or parts.password is not None:
        raise ValueError(f"{url!r} carries a user name or password")
    if parts.path not in ("", "/") or parts.query or parts.fragment:
        raise ValueError(f"{url!r} has a path, query or fragment (an endpoint is scheme://host[:port])")
    host = parts.hostname.lower()
    if ":" in host:  # IPv6, bracketed again
        host = f"[{host}]"
    return f"{parts.scheme}://{host}:{port or _DEFAULT_PORTS[parts.scheme]}"


def refusal(endpoint: str | None, allowed: tuple[str, ...]) -> str | None:
    """Why ``endpoint`` may not be used (None: it may). ``allowed`` holds origins (see :func:`origin`)."""
    if endpoint is None:
        return None
    try:
        wanted = origin(endpoint)
    except ValueError as error:
        return f"spec.tracing.archive.s3.endpoint: {error}"
    if wanted in allowed:
        return None
    listed = ", ".join(allowed) if allowed else "none"
    return (
        f"spec.tracing.archive.s3.endpoint {wanted} is not one of the operator's archive endpoints ({listed}); "
        "ask the operator's admin to add it (Helm operator.archive.endpoints) or leave it unset for AWS S3"
    )
