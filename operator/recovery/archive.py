"""Keep an evidence directory in the job's S3-compatible bucket (``spec.tracing.archive.s3``).

Keys: ``<prefix>/<namespace>/<job>/<job uid>/attempt-<n>/<UTC time>-<reason>/<file>``, the manifest
last, so a listing that shows ``manifest.json`` shows a complete archive. Credentials come from the
Secret the spec names (keys ``accessKeyId``, ``secretAccessKey``, optional ``sessionToken``), read
through the API when needed; they are never logged, put in an error message or written to status.
Blocking (boto3): call from a worker thread.
"""

from __future__ import annotations

import base64
import re
from dataclasses import dataclass, field
from pathlib import Path

import kubernetes
from kubernetes.client.exceptions import ApiException

from rankwatch.analysis.archive import MANIFEST, s3_client
from rankwatch.operator.spec import S3Archive

ACCESS_KEY, SECRET_KEY, SESSION_TOKEN = "accessKeyId", "secretAccessKey", "sessionToken"
CREDENTIALS_LABEL = "rankwatch.io/archive-credentials"
"""A Secret rankwatch reads as archive credentials must carry this label (``"true"``): a job names a
Secret by name, and without the opt-in it could have the operator read any Secret of its namespace."""
_ERROR_CODE = re.compile(r"[A-Za-z][A-Za-z0-9.]{0,63}")


class ArchiveFailed(RuntimeError):
    """The evidence could not be kept; the message says why, without credentials."""


@dataclass(frozen=True)
class S3Credentials:
    access_key: str = field(repr=False)
    secret_key: str = field(repr=False)
    session_token: str | None = field(default=None, repr=False)


def read_credentials(kube: kubernetes.client.ApiClient, namespace: str, secret_name: str) -> S3Credentials:
    try:
        secret = kubernetes.client.CoreV1Api(kube).read_namespaced_secret(secret_name, namespace)
    except ApiException as error:
        raise ArchiveFailed(
            f"Secret {namespace}/{secret_name} (spec.tracing.archive.s3.secretRef) not readable: HTTP {error.status}"
        ) from None
    if (secret.metadata.labels or {}).get(CREDENTIALS_LABEL) != "true":
        raise ArchiveFailed(
            f"Secret {namespace}/{secret_name} (spec.tracing.archive.s3.secretRef) is not labelled "
            f"{CREDENTIALS_LABEL}=true; label it to let rankwatch use it for the archive"
        )
    data = {key: base64.b64decode(value).decode() for key, value in (secret.data or {}).items()}
    missing = [key for key in (ACCESS_KEY, SECRET_KEY) if not data.get(key)]
    if missing:
        raise ArchiveFailed(f"Secret {namespace}/{secret_name} lacks the key(s) {', '.join(missing)}")
    return S3Credentials(data[ACCESS_KEY], data[SECRET_KEY], data.get(SESSION_TOKEN) or None)


REGION = re.compile(r"(?![0-9]+$)(?!-)[a-zA-Z0-9-]{1,63}(?<!-)")
"""What botocore accepts as a region name (a host label); the CRD's pattern says the same."""
PREFIX = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9._-]{0,62}")
"""One path segment: the namespace and job name follow it, so a job writes only below its own."""


def check_target(target: S3Archive) -> None:
    """ArchiveFailed when the region or the prefix cannot be used. The CRD refuses both; a job stored
    under an older CRD may still carry them, and its evidence is then not kept (its run goes on)."""
    if not REGION.fullmatch(str(target.region)):
        raise ArchiveFailed(
            f"spec.tracing.archive.s3.region {target.region!r} is not a region name "
            "(letters, digits and inner hyphens, at most 63: eu-west-1)"
        )
    if not PREFIX.fullmatch(str(target.prefix)):
        raise ArchiveFailed(
            f"spec.tracing.archive.s3.prefix {target.prefix!r} is not one path segment (letters, digits, '.', "
            "'_', '-'): the namespace and job name follow it, so that a job writes only below its own"
        )


def key_prefix(target: S3Archive, namespace: str, job: str, uid: str, attempt: int, moment: str, reason: str) -> str:
    """``<prefix>/<namespace>/<job>/<uid>/attempt-<n>/<time>-<reason>``; ArchiveFailed for a target
    :func:`check_target` refuses."""
    check_target(target)
    stamp = moment.replace(":", "").replace("-", "")
    parts = [target.prefix.strip("/"), namespace, job, uid, f"attempt-{attempt}", f"{stamp}-{reason.lower()}"]
    return "/".join(part for part in parts if part)


def upload(directory: Path, target: S3Archive, credentials: S3Credentials, prefix: str) -> str:
    """Upload every file under ``directory`` (the manifest last); returns ``s3://bucket/prefix/``."""
    from boto3.exceptions import S3UploadFailedError
    from boto3.s3.transfer import TransferConfig
    from botocore.exceptions import BotoCoreError, ClientError

    # boto3's default (10 threads x 8 MiB parts) would hold about 80 MiB of the operator's memory.
    transfer = TransferConfig(multipart_chunksize=8 << 20, max_concurrency=2)
    files = sorted(path for path in directory.rglob("*") if path.is_file())
    files.sort(key=lambda path: path.name == MANIFEST)  # the manifest last: its presence means complete
    try:
        client = s3_client(
            target.endpoint, target.region, credentials.access_key, credentials.secret_key, credentials.session_token
        )
        for path in files:
            client.upload_file(
                str(path), target.bucket, f"{prefix}/{path.relative_to(directory).as_posix()}", Config=transfer
            )
    except (BotoCoreError, ClientError, S3UploadFailedError) as error:
        where = target.endpoint or "AWS S3"
        raise ArchiveFailed(f"upload to bucket {target.bucket} at {where} failed: {_reason(error)}") from None
    return f"s3://{target.bucket}/{prefix}/"


def _reason(error: BaseException) -> str:
    """The HTTP status and the server's error code when it is a plain word (``AccessDenied``), nothing
    more: the server's own text (its message, its body) is the server's to choose, and it goes into
    status and Events. Never the request either, which carries the signature."""
    while not getattr(error, "response", None) and (error.__cause__ or error.__context__) is not None:
        error = error.__cause__ or error.__context__  # boto3 wraps the ClientError of a failed upload
    response = getattr(error, "response", None) or {}
    code = str((response.get("Error") or {}).get("Code") or "")
    status = (response.get("ResponseMetadata") or {}).get("HTTPStatusCode")
    if response:
        said = code if _ERROR_CODE.fullmatch(code) else "an error"
        return f"HTTP {status}: {said}" if status else said
    return type(error).__name__
