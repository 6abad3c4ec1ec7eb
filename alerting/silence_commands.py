"""``rankwatch alerts silence add|ls|rm``: the intake's silences API from the command line, as amtool is
Alertmanager's.

The silences live in the running pipeline (the operator, or ``rankwatch alerts serve``) and its store, so
the commands talk to its intake over HTTP (``--url``, e.g. through ``kubectl port-forward`` to the
``-intake`` Service) with the intake's bearer token: a silence added here mutes at once (or from its
``--starts-at``), and the pipeline decides the rules (a bad duration or time is answered by it).
"""

from __future__ import annotations

import getpass
import json
import os
import sys
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

URL_VARIABLE = "RANKWATCH_INTAKE_URL"
TOKEN_VARIABLE = "RANKWATCH_INTAKE_TOKEN"
TIMEOUT_S = 30.0


class SilenceCommandError(Exception):
    """What went wrong, in one line for the person at the terminal."""


@dataclass(frozen=True)
class Intake:
    """Where the intake is and how to authenticate to it."""

    url: str  # ends in /alerting
    token: str

    @classmethod
    def from_arguments(cls, url: str | None, token_file: str | None) -> Intake:
        url = url or os.environ.get(URL_VARIABLE)
        if not url:
            raise SilenceCommandError(
                f"give --url (or ${URL_VARIABLE}): the intake, e.g. http://127.0.0.1:8081/alerting after "
                "`kubectl -n rankwatch-system port-forward svc/<release>-rankwatch-intake 8081`"
            )
        if token_file:
            try:
                token = Path(token_file).read_text().strip()
            except OSError as error:
                raise SilenceCommandError(f"--token-file {token_file}: {error.strerror or error}") from None
        else:
            token = os.environ.get(TOKEN_VARIABLE, "")
        if not token:
            raise SilenceCommandError(
                f"give --token-file (or ${TOKEN_VARIABLE}): the intake's bearer token (Secret rankwatch-intake)"
            )
        return cls(url.rstrip("/"), token)

    def call(self, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
        """The intake's JSON answer; its refusal text (400, 401, 404) or the connection failure as the error."""
        data = json.dumps(body).encode() if body is not None else None
        request = urllib.request.Request(
            f"{self.url}{path}",
            data=data,
            method=method,
            headers={"Authorization": f"Bearer {self.token}", "Content-Type": "application/json"},
        )
        try:
            with urllib.request.urlopen(request, timeout=TIMEOUT_S) as response:
                return json.loads(response.read() or b"null")
        except urllib.error.HTTPError as error:
            text = error.read().decode(errors="replace").strip() or error.reason
            raise SilenceCommandError(f"{text} (HTTP {error.code} from {self.url})") from None
        except (urllib.error.URLError, OSError) as error:
            reason = getattr(error, "reason", error)
            raise SilenceCommandError(f"cannot reach the intake at {self.url}: {reason}") from None
        except ValueError:
            raise SilenceCommandError(f"{self.url}{path} answered something that is not JSON") from None


def add(
    intake: Intake,
    matchers: list[str],
    duration: str | None,
    starts_at: str | None,
    ends_at: str | None,
    comment: str,
    created_by: str | None,
) -> dict[str, Any]:
    """The silence as the intake stored it."""
    if not matchers:
        raise SilenceCommandError('give at least one matcher, e.g. node="gpu-node-3" or alertname=~"TrainingJob.*"')
    if bool(duration) == bool(ends_at):
        raise SilenceCommandError("give one of --duration (e.g. 2h) or --ends-at (RFC 3339)")
    body: dict[str, Any] = {"matchers": matchers, "comment": comment, "createdBy": created_by or _user()}
    body.update({key: value for key, value in (("duration", duration), ("startsAt", starts_at), ("endsAt", ends_at))
                 if value})  # fmt: skip
    return intake.call("POST", "/silences", body)


def listed(intake: Intake) -> list[dict[str, Any]]:
    return list(intake.call("GET", "/silences") or [])


def remove(intake: Intake, silence_id: str) -> None:
    intake.call("DELETE", f"/silences/{urllib.request.quote(silence_id, safe='')}")


def table(silences: list[dict[str, Any]]) -> str:
    """One line per silence, earliest start first."""
    rows = [("ID", "STATE", "STARTS", "ENDS", "CREATED BY", "MATCHERS", "COMMENT")]
    for silence in sorted(silences, key=lambda s: s.get("startsAt", "")):
        rows.append(
            (
                silence.get("id", ""),
                (silence.get("status") or {}).get("state", ""),
                silence.get("startsAt", ""),
                silence.get("endsAt", ""),
                silence.get("createdBy", ""),
                ",".join(silence.get("matchers") or []),
                silence.get("comment", ""),
            )
        )
    widths = [max(len(row[column]) for row in rows) for column in range(len(rows[0]) - 1)]
    return "\n".join(
        "  ".join(cell.ljust(width) for cell, width in zip(row[:-1], widths, strict=True)) + "  " + row[-1]
        for row in rows
    )


def _user() -> str:
    try:
        return getpass.getuser()
    except (KeyError, OSError):
        return ""


def run(args: Any) -> int:
    """``rankwatch alerts silence ...`` from its parsed arguments."""
    try:
        intake = Intake.from_arguments(args.url, args.token_file)
        if args.silence_action == "add":
            silence = add(
                intake, args.matchers, args.duration, args.starts_at, args.ends_at, args.comment, args.created_by
            )
            state = (silence.get("status") or {}).get("state", "")
            print(f"{silence['id']}  {state} from {silence['startsAt']} to {silence['endsAt']}")
        elif args.silence_action == "ls":
            silences = listed(intake)
            print(json.dumps(silences, indent=2) if args.output == "json" else table(silences))
        else:
            remove(intake, args.id)
            print(f"{args.id}: expired")
    except SilenceCommandError as error:
        print(f"rankwatch alerts silence {args.silence_action}: {error}", file=sys.stderr)
        return 1
    return 0
