"""Read an attempt's archive (what the operator keeps before it deletes a job's pods) as analysis input:
a local directory or an ``s3://bucket/prefix`` URL.

An archive is a directory holding ``manifest.json`` with ``rings/`` (every rank's ring window),
``files/<pod>/megatrace/rank_<R>.log`` (the stall watch's Megatrace logs) and
``files/<pod>/flight_recorder_rank_<R>`` (PyTorch flight-recorder dumps) and
``files/<pod>/megascan/benchmark-data-<dp>-pipeline-<pp>-tensor-<tp>.json`` (MegaScan traces). The rings
are analysed when there are any (they carry return and GPU times), else the Megatrace logs, else the
flight-recorder dumps, else the MegaScan traces.
A URL or directory above several archives (a job, an attempt) means the newest of them.

S3 credentials and endpoint come from boto3's usual sources (``AWS_ACCESS_KEY_ID``,
``AWS_SECRET_ACCESS_KEY``, ``AWS_ENDPOINT_URL_S3`` / ``AWS_ENDPOINT_URL``, ``~/.aws``), or
``endpoint`` for an S3-compatible server.
"""

from __future__ import annotations

import contextlib
import json
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

from rankwatch.analysis.topology import Layout, LayoutError

MANIFEST = "manifest.json"
S3_SCHEME = "s3://"


class ArchiveError(ValueError):
    """Not an archive, or one that cannot be read; the message names it and says why."""


def is_s3_url(path: str) -> bool:
    return path.startswith(S3_SCHEME)


def parse_s3_url(url: str) -> tuple[str, str]:
    """(bucket, key prefix without a trailing slash)."""
    bucket, _, prefix = url[len(S3_SCHEME) :].partition("/")
    if not bucket:
        raise ArchiveError(f"{url}: expected s3://<bucket>/<prefix>")
    return bucket, prefix.strip("/")


def s3_client(
    endpoint: str | None = None,
    region: str | None = None,
    access_key: str | None = None,
    secret_key: str | None = None,
    session_token: str | None = None,
) -> Any:
    """A boto3 S3 client; path-style addressing for a custom endpoint (MinIO and most S3-compatible
    servers); explicit credentials when given, else boto3's own sources."""
    import boto3
    from botocore.config import Config

    config = Config(
        s3={"addressing_style": "path"} if endpoint else {},
        retries={"max_attempts": 5, "mode": "standard"},
        connect_timeout=10,
        read_timeout=60,
    )
    return boto3.client(
        "s3",
        endpoint_url=endpoint,
        region_name=region,
        aws_access_key_id=access_key,
        aws_secret_access_key=secret_key,
        aws_session_token=session_token,
        config=config,
    )


def _newest_archive(manifests: list[str]) -> str:
    """The directory of the newest manifest among keys/paths (archive directories sort by time)."""
    if not manifests:
        raise ArchiveError("no manifest.json below it: not a rankwatch archive")
    return str(PurePosixPath(sorted(manifests)[-1]).parent)


def download(url: str, directory: Path, client: Any = None) -> Path:
    """Copy the (newest) archive under ``url`` into ``directory``; returns the local archive directory."""
    from botocore.exceptions import BotoCoreError, ClientError

    bucket, prefix = parse_s3_url(url)
    client = client or s3_client()
    try:
        keys = [
            item["Key"]
            for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
            for item in page.get("Contents", [])
        ]
        manifests = [key for key in keys if PurePosixPath(key).name == MANIFEST]
        try:
            root = _newest_archive(manifests)
        except ArchiveError as error:
            raise ArchiveError(f"{url}: {error}") from None
        for key in keys:
            relative = PurePosixPath(key).relative_to(root) if key.startswith(root + "/") else None
            if relative is None or ".." in relative.parts:
                continue
            target = directory.joinpath(*relative.parts)
            target.parent.mkdir(parents=True, exist_ok=True)
            client.download_file(bucket, key, str(target))
    except (BotoCoreError, ClientError) as error:
        raise ArchiveError(f"{url}: {error}") from error
    return directory


def find_archive(path: Path) -> Path:
    """``path`` if it holds a manifest, else the newest archive below it."""
    if (path / MANIFEST).is_file():
        return path
    manifests = [str(found) for found in path.rglob(MANIFEST)]
    try:
        return Path(_newest_archive(manifests))
    except ArchiveError as error:
        raise ArchiveError(f"{path}: {error}") from None


def is_archive(path: str) -> bool:
    if is_s3_url(path):
        return True
    local = Path(path)
    return local.is_dir() and (local / MANIFEST).is_file()


def manifest(archive: Path) -> dict[str, Any]:
    try:
        return json.loads((archive / MANIFEST).read_text())
    except (OSError, ValueError) as error:
        raise ArchiveError(f"{archive / MANIFEST}: {error}") from error


def _gathered(files: list[Path], directory: Path) -> Path:
    """One directory with links to ``files`` (one per rank; pods keep theirs in separate folders)."""
    directory.mkdir(parents=True, exist_ok=True)
    for path in files:
        link = directory / path.name
        if not link.exists():
            link.symlink_to(path.resolve())
    return directory


@dataclass(frozen=True)
class ArchiveSource:
    directory: Path
    """What to analyse: the rings, or a directory gathering the Megatrace logs or flight-recorder dumps."""
    description: str
    layout: Layout | None
    """The job's parallel layout, as the manifest records it."""


def _layout(about: dict[str, Any]) -> Layout | None:
    layout = about.get("layout") or {}
    try:
        return Layout(int(layout["tensor"]), int(layout["pipeline"]), int(layout["world_size"]))
    except (KeyError, TypeError, ValueError, LayoutError):
        return None


@contextlib.contextmanager
def trace_source(path: str, endpoint: str | None = None) -> Iterator[ArchiveSource]:
    """What to analyse in the archive at ``path`` (local or s3://); temporary files go on exit."""
    with tempfile.TemporaryDirectory(prefix="rankwatch-archive-") as temporary:
        if is_s3_url(path):
            archive = download(path, Path(temporary) / "archive", s3_client(endpoint) if endpoint else None)
        else:
            archive = find_archive(Path(path))
        about = manifest(archive)
        where = f"archive of {about.get('namespace')}/{about.get('job')} attempt {about.get('attempt')} ({about.get('reason')}, {about.get('time')})"  # noqa: E501
        layout = _layout(about)
        rings = archive / "rings"
        if any(rings.glob("*.ring")):
            yield ArchiveSource(rings, f"{where}: rings", layout)
            return
        files = archive / "files"
        logs = sorted(files.glob("*/megatrace/rank_*.log"))
        if logs:
            yield ArchiveSource(_gathered(logs, Path(temporary) / "megatrace"), f"{where}: Megatrace logs", layout)
            return
        dumps = sorted(files.glob("*/flight_recorder_rank_*"))
        if dumps:
            gathered = _gathered(dumps, Path(temporary) / "flight-recorder")
            yield ArchiveSource(gathered, f"{where}: flight-recorder dumps", layout)
            return
        megascan = sorted(files.glob("*/megascan/benchmark-data-*-pipeline-*-tensor-*.json"))
        if megascan:
            yield ArchiveSource(_gathered(megascan, Path(temporary) / "megascan"), f"{where}: MegaScan traces", layout)
            return
        raise ArchiveError(
            f"{path}: the archive holds no rings, Megatrace logs, flight-recorder dumps or MegaScan traces"
        )
