"""The operator asks a pod's sidecar at the pod IP only: a pod annotation cannot send it (and the job's
token) anywhere else, and what a sidecar answers is read up to a bound. Real HTTP servers on loopback."""

from __future__ import annotations

import io
import tarfile
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from aiohttp import web

from rankwatch import protocol
from rankwatch.operator.config import ConfigError, OperatorConfig
from rankwatch.operator.recovery.evidence import fetch_files
from rankwatch.operator.sidecar_client import SIDECAR_ENDPOINT_ANNOTATION, ByteAllowance, SidecarPod, fetch_dumps

TOKEN = "job-token-secret"


def pod(annotation: str | None, pod_ip: str = "127.0.0.1") -> dict:
    annotations = {SIDECAR_ENDPOINT_ANNOTATION: annotation} if annotation else {}
    return {
        "metadata": {"name": "llama-worker-0", "namespace": "team-a", "annotations": annotations},
        "spec": {"nodeName": "gpu-0"},
        "status": {"podIP": pod_ip},
    }


class Server:
    """A loopback HTTP server recording what it was asked (and with which Authorization)."""

    def __init__(self, body: bytes = b"", chunks: int = 1) -> None:
        self.requests: list[tuple[str, str | None]] = []
        self.body, self.chunks = body, chunks
        self.port = 0

    async def answer(self, request: web.Request) -> web.StreamResponse:
        self.requests.append((request.path, request.headers.get("Authorization")))
        response = web.StreamResponse()
        await response.prepare(request)
        for _ in range(self.chunks):
            await response.write(self.body)
        await response.write_eof()
        return response


@pytest.fixture
async def servers() -> AsyncIterator:
    runners = []

    async def start(server: Server) -> Server:
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", server.answer)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        server.port = runner.addresses[0][1]
        runners.append(runner)
        return server

    yield start
    for runner in runners:
        await runner.cleanup()


async def test_the_annotation_cannot_send_the_token_to_another_server(servers, tmp_path: Path):
    attacker = await servers(Server(b"x"))
    sidecar = await servers(Server(b"ring bytes"))
    target = SidecarPod.from_pod(pod(f"http://127.0.0.1:{attacker.port}/steal?x=1"), sidecar.port)
    assert target.endpoint == f"http://127.0.0.1:{sidecar.port}"
    answered, problems = await fetch_dumps([target], TOKEN, 10, tmp_path, 1 << 20)
    assert (answered, problems) == (1, [])
    assert attacker.requests == [], "nothing, and no token, reached the annotated URL"
    assert sidecar.requests == [(protocol.DUMP_PATH, protocol.bearer(TOKEN))]


def test_the_annotation_is_honoured_only_for_hosts_the_operator_trusts():
    trusted = ("127.0.0.1",)
    assert SidecarPod.from_pod(pod("http://127.0.0.1:4711/x?y#z"), 9400, trusted).endpoint == "http://127.0.0.1:4711"
    for hostile in (
        "http://metadata.google.internal/computeMetadata/v1",
        "http://169.254.169.254:80",
        "http://127.0.0.1.evil.example:4711",
        "http://user:pw@127.0.0.1:4711",
        "file:///etc/passwd",
        "http://127.0.0.1:99999",
        "not a url",
    ):
        assert SidecarPod.from_pod(pod(hostile, "10.1.2.3"), 9400, trusted).endpoint == "http://10.1.2.3:9400", hostile
    assert SidecarPod.from_pod(pod(None, "fd00::5"), 9400).endpoint == "http://[fd00::5]:9400"


def test_trusted_hosts_come_from_the_operators_configuration_and_are_checked():
    config = OperatorConfig.from_env({"RANKWATCH_SIDECAR_ENDPOINT_HOSTS": "127.0.0.1, ::1"})
    assert config.pods.sidecar_endpoint_hosts == ("127.0.0.1", "::1")
    assert OperatorConfig.from_env({}).pods.sidecar_endpoint_hosts == ()
    with pytest.raises(ConfigError, match="RANKWATCH_SIDECAR_ENDPOINT_HOSTS='\\*': '\\*' is not a host"):
        OperatorConfig.from_env({"RANKWATCH_SIDECAR_ENDPOINT_HOSTS": "*"})


async def test_a_dump_larger_than_its_share_is_cut_off_and_reported(servers, tmp_path: Path):
    sidecar = await servers(Server(b"r" * (256 << 10), chunks=64))  # 16 MiB streamed
    target = SidecarPod("llama-worker-0", "gpu-0", f"http://127.0.0.1:{sidecar.port}")
    answered, problems = await fetch_dumps([target], TOKEN, 10, tmp_path, 1 << 20)
    assert answered == 0 and "more than 1 MiB" in problems[0]
    assert list(tmp_path.iterdir()) == []


async def test_evidence_larger_than_its_bound_is_refused_and_nothing_is_unpacked(servers, tmp_path: Path):
    sidecar = await servers(Server(b"t" * (256 << 10), chunks=64))
    target = SidecarPod("llama-worker-0", "gpu-0", f"http://127.0.0.1:{sidecar.port}")
    files, problems = await fetch_files([target], TOKEN, tmp_path, max_bytes_per_pod=1 << 20)
    assert files == [] and "more than 1 MiB" in problems[0]
    assert list(tmp_path.iterdir()) == []


async def test_a_compressed_evidence_tar_is_refused(servers, tmp_path: Path):
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as archive:  # a tar bomb would hide in the gzip
        data = b"\0" * (4 << 20)
        info = tarfile.TarInfo("megatrace/rank_0.log")
        info.size = len(data)
        archive.addfile(info, io.BytesIO(data))
    sidecar = await servers(Server(buffer.getvalue()))
    target = SidecarPod("llama-worker-0", "gpu-0", f"http://127.0.0.1:{sidecar.port}")
    files, problems = await fetch_files([target], TOKEN, tmp_path, max_bytes_per_pod=1 << 20)
    assert files == [] and "not a readable tar" in problems[0]


async def test_evidence_within_its_bound_is_unpacked_and_nothing_else_is_left(servers, tmp_path: Path):
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as archive:  # as the sidecar sends it: a plain tar
        for name, data in (("megatrace/rank_0.log", b"[save_count 1] ...\n"), ("flight_recorder_rank_0", b"{}")):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            archive.addfile(info, io.BytesIO(data))
        escape = tarfile.TarInfo("../outside")
        escape.size = 1
        archive.addfile(escape, io.BytesIO(b"x"))
    sidecar = await servers(Server(buffer.getvalue()))
    target = SidecarPod("llama-worker-0", "gpu-0", f"http://127.0.0.1:{sidecar.port}")
    files, problems = await fetch_files([target], TOKEN, tmp_path / "files")
    assert problems == []
    assert sorted(path.relative_to(tmp_path / "files").as_posix() for path in files) == [
        "llama-worker-0/flight_recorder_rank_0",
        "llama-worker-0/megatrace/rank_0.log",
    ]
    assert (tmp_path / "files" / "llama-worker-0" / "megatrace" / "rank_0.log").read_bytes() == b"[save_count 1] ...\n"
    left = sorted(path.relative_to(tmp_path).as_posix() for path in tmp_path.rglob("*") if path.is_file())
    assert left == ["files/llama-worker-0/flight_recorder_rank_0", "files/llama-worker-0/megatrace/rank_0.log"]
    assert sidecar.requests == [(protocol.EVIDENCE_PATH, protocol.bearer(TOKEN))]


async def test_one_byte_budget_holds_for_the_whole_archive_however_many_pods(servers, tmp_path: Path):
    """Each pod within its own bound, together past the archive's: the pods beyond it are named, not kept."""
    sidecars = [await servers(Server(b"r" * (256 << 10), chunks=4)) for _ in range(3)]  # 1 MiB each
    targets = [SidecarPod(f"llama-worker-{i}", "gpu-0", f"http://127.0.0.1:{s.port}") for i, s in enumerate(sidecars)]
    allowance = ByteAllowance((2 << 20) + (512 << 10))
    answered, problems = await fetch_dumps(targets, TOKEN, 10, tmp_path, 1 << 30, allowance)
    assert answered == 2 and len(problems) == 1 and "the archive's budget of 2 MiB is spent" in problems[0]
    assert sum(path.stat().st_size for path in tmp_path.iterdir()) == 2 << 20
    files, problems = await fetch_files(targets[:1], TOKEN, tmp_path / "files", allowance=allowance)
    assert files == [] and "budget of 2 MiB is spent" in problems[0], "the files share what the dumps left"
