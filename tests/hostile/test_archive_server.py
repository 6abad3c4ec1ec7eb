"""A hostile S3 endpoint (a real HTTP server on loopback): what it answers never reaches the job's
status or Events beyond its HTTP status and a plain error code."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from rankwatch.operator.recovery import archive
from rankwatch.operator.spec import S3Archive

MESSAGE = "**Click** [here](http://evil.example/steal) <b>now</b>"


def hostile_server(code: str) -> ThreadingHTTPServer:
    class Refuse(BaseHTTPRequestHandler):
        def do_PUT(self) -> None:
            self.rfile.read(int(self.headers.get("Content-Length") or 0))
            body = f"<?xml version='1.0'?><Error><Code>{code}</Code><Message>{MESSAGE}</Message></Error>".encode()
            self.send_response(403)
            self.send_header("Content-Type", "application/xml")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *_: object) -> None:
            pass

    return ThreadingHTTPServer(("127.0.0.1", 0), Refuse)


@pytest.fixture
def server(request) -> Iterator[str]:
    httpd = hostile_server(request.param)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()


@pytest.mark.parametrize(
    ("server", "said"),
    [("AccessDenied", "HTTP 403: AccessDenied"), ("Denied\nCIRCUIT BREAKER OPEN " + "x" * 100, "HTTP 403: an error")],
    indirect=["server"],
)
def test_the_servers_error_text_is_not_copied_into_the_problem(server, said, tmp_path):
    (tmp_path / "manifest.json").write_text("{}")
    target = S3Archive(bucket="evidence", secretRef="s", endpoint=server)
    credentials = archive.S3Credentials("AKIAEXAMPLE", "secret-key-not-shown", "session-token-not-shown")
    with pytest.raises(archive.ArchiveFailed) as failed:
        archive.upload(tmp_path, target, credentials, "rankwatch/team-a/llama")
    problem = str(failed.value)
    assert problem.endswith(said), problem
    assert "evil" not in problem and "Click" not in problem and "CIRCUIT" not in problem
    assert "secret-key-not-shown" not in problem and "session-token-not-shown" not in problem
