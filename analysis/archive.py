"""Read an attempt's archive (what the operator keeps before it deletes a job's pods) as analysis input:
a local directory or an ``s3://bucket/prefix`` URL.

An archive is a directory holding ``manifest.json`` with ``rings/`` (every rank's ring window),
``files/<pod>/megatrace/rank_<R>.log`` (the stall watch's Megatrace logs) and
``files/<pod>/flight_recorder_rank_<R>`` (PyTorch flight-recorder dumps). The rings are analysed when
there are any (they carry return and GPU times), else the Megatrace logs, else the flight-recorder dumps.
A URL or directory above several archives (a job, an attempt) means the newest of them.

S3 credentials and endpoint come from boto3's usual sources (``AWS_ACCESS_KEY_ID``,
``AWS_SECRET_ACCESS_KEY``, ``AWS_ENDPOINT_URL_S3`` / ``AWS_ENDPOINT_URL``, ``~/.aws``), or
``endpoint`` for an S3-compatible server.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import stat
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


_ATTEMPT = re.compile(r"attempt-(\d{1,9})")
_STAMP = re.compile(r"(\d{8}T\d{6}Z)-")


def _when(manifest: str) -> tuple[str, int, str]:
    """An archive's age from its path, ``.../attempt-<n>/<UTC time>-<reason>/manifest.json``: the time,
    then the attempt number (as a number: attempt-10 is after attempt-9), then the path."""
    attempt, stamp = -1, ""
    for part in PurePosixPath(manifest).parts[:-1]:
        if found := _ATTEMPT.fullmatch(part):
            attempt = int(found.group(1))
        elif found := _STAMP.match(part):
            stamp = found.group(1)
    return stamp, attempt, manifest


def _newest_archive(manifests: list[str]) -> str:
    """The directory of the newest manifest among keys/paths."""
    if not manifests:
        raise ArchiveError("no manifest.json below it: not a rankwatch archive")
    return str(PurePosixPath(max(manifests, key=_when)).parent)


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


def _inside(archive: Path, candidates: list[Path], problems: list[str]) -> list[Path]:
    """The candidates that are regular files inside ``archive`` itself: an archive is a tenant's
    upload, and a symbolic link in it (``rank_0.log`` -> a token file) must not make us read, and
    report, a file of the machine reading it. The others are named in ``problems``."""
    root = archive.resolve()
    kept = []
    for path in candidates:
        try:
            regular = stat.S_ISREG(os.lstat(path).st_mode) and path.resolve().is_relative_to(root)
        except (OSError, RuntimeError):  # RuntimeError: a symlink loop
            regular = False
        if regular:
            kept.append(path)
        else:
            where = path.relative_to(archive)
            problems.append(f"{where}: not a regular file inside the archive (a symbolic link?): not read")
    return kept


def manifest(archive: Path) -> dict[str, Any]:
    if not _inside(archive, [archive / MANIFEST], []):
        raise ArchiveError(f"{archive / MANIFEST}: not a regular file inside the archive (a symbolic link?)")
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
    """What to analyse: a directory gathering the rings, the Megatrace logs or the flight-recorder dumps."""
    description: str
    layout: Layout | None
    """The job's parallel layout, as the manifest records it."""
    problems: tuple[str, ...] = ()
    """Files of the archive left unread (not regular files inside it)."""


def _layout(about: dict[str, Any]) -> Layout | None:
    layout = about.get("layout") or {}
    try:
        return Layout(int(layout["tensor"]), int(layout["pipeline"]), int(layout["world_size"]))
    except (KeyError, TypeError, ValueError, LayoutError):
        return None


@contextlib.contextmanager
def trace_source(path: str, endpoint: str | None = None) -> Iterator[ArchiveSource]:
    """What to analyse in the archive at ``path`` (local or s3://); temporary files go on exit. Only
    regular files inside the archive are read: symbolic links are not followed."""
    with tempfile.TemporaryDirectory(prefix="rankwatch-archive-") as temporary:
        if is_s3_url(path):
            archive = download(path, Path(temporary) / "archive", s3_client(endpoint) if endpoint else None)
        else:
            archive = find_archive(Path(path))
        about = manifest(archive)
        where = f"archive of {about.get('namespace')}/{about.get('job')} attempt {about.get('attempt')} ({about.get('reason')}, {about.get('time')})"  # noqa: E501
        layout = _layout(about)
        problems: list[str] = []
        rings = _inside(archive, sorted((archive / "rings").glob("*.ring")), problems)
        if rings:
            yield ArchiveSource(_gathered(rings, Path(temporary) / "rings"), f"{where}: rings", layout, tuple(problems))
            return
        files = archive / "files"
        logs = _inside(archive, sorted(files.glob("*/megatrace/rank_*.log")), problems)
        if logs:
            gathered = _gathered(logs, Path(temporary) / "megatrace")
            yield ArchiveSource(gathered, f"{where}: Megatrace logs", layout, tuple(problems))
            return
        dumps = _inside(archive, sorted(files.glob("*/flight_recorder_rank_*")), problems)
        if dumps:
            gathered = _gathered(dumps, Path(temporary) / "flight-recorder")
            yield ArchiveSource(gathered, f"{where}: flight-recorder dumps", layout, tuple(problems))
            return
        refused = f" ({'; '.join(problems)})" if problems else ""
        raise ArchiveError(f"{path}: the archive holds no rings, Megatrace logs or flight-recorder dumps{refused}")
