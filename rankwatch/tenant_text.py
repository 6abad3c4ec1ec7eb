"""Text a job author controls, bounded and escaped for the place it goes.

A training job's frames, profile function names, pod and job names, its sidecar's and its bucket's
error bodies all end up in places other teams and the people on call read: the operator's log, Events,
the job's status and annotations, alert annotations and Feishu cards. Each of those places has its
own markup (a newline starts a new log line; ``**`` is bold in a card), so every such string goes
through one of these functions on its way there, cut to a bound first:

- :func:`one_line`: log lines, Events, status, annotations. Control characters (newlines, escape
  sequences, Unicode line separators, bidi overrides) become visible escapes (``\\n``, ``\\x1b``):
  a tenant cannot start a line of its own nor recolour a terminal.
- :func:`lark_md`: Feishu ``lark_md`` card text. Markup characters become HTML character references
  (which Feishu shows as the characters), and ``://`` loses its link-making colon: tenant text is
  shown, never bold, a link, a mention or a heading. Newlines stay (cards lay out lines).
- :func:`one_line_strings`: every string of a JSON-like value (a status patch) made :func:`one_line`.
- :func:`bounded` and :func:`bounded_strings`: only the bound (alert annotations, JSON evidence).
"""

from __future__ import annotations

import logging
import re
from typing import Any

ELLIPSIS = "…"
LINE_LIMIT = 2000
"""An Event or status text longer than this is cut."""
LOG_LINE_LIMIT = 16000
"""A log line longer than this is cut."""

# C0 and C1 controls, DEL, and the format characters that move or reorder text on a screen.
_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029\u200e\u200f\u202a-\u202e\u2066-\u2069]")
_NAMED = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}
_CARD_CONTROL = re.compile("[\x00-\x09\x0b-\x1f\x7f-\x9f\u2028\u2029\u202a-\u202e\u2066-\u2069]")
_LARK_MD = str.maketrans({c: f"&#{ord(c)};" for c in "&<>*_~`[]#\\|"})


def bounded(text: object, limit: int) -> str:
    """``text`` (``str()`` of it), at most ``limit`` characters, the cut marked with an ellipsis."""
    text = text if isinstance(text, str) else str(text)
    return text if len(text) <= limit else text[: max(0, limit - 1)] + ELLIPSIS


def bounded_strings(value: Any, limit: int) -> Any:
    """A JSON-like value with every string in it (keys too) cut to ``limit`` characters."""
    if isinstance(value, str):
        return bounded(value, limit)
    if isinstance(value, dict):
        return {bounded(str(k), limit): bounded_strings(v, limit) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [bounded_strings(v, limit) for v in value]
    return value


def one_line_strings(value: Any, limit: int = LINE_LIMIT) -> Any:
    """A JSON-like value with every string in it made :func:`one_line` (a status patch, say)."""
    if isinstance(value, str):
        return one_line(value, limit)
    if isinstance(value, dict):
        return {k: one_line_strings(v, limit) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [one_line_strings(v, limit) for v in value]
    return value


def _escape_control(match: re.Match[str]) -> str:
    character = match.group()
    return _NAMED.get(character) or (
        f"\\x{ord(character):02x}" if ord(character) < 0x100 else f"\\u{ord(character):04x}"
    )


def one_line(text: object, limit: int = LINE_LIMIT) -> str:
    """For a log line, an Event, a status field or an annotation: bounded, control characters escaped."""
    text = text if isinstance(text, str) else str(text)
    return bounded(_CONTROL.sub(_escape_control, text[: limit * 2]), limit)


def lark_md(text: object, limit: int) -> str:
    """For Feishu card Markdown (``lark_md``): every markup character written as a character reference,
    newlines kept, other control characters escaped; at most ``limit`` characters once escaped (a
    card has a byte budget, and a text of markup characters grows fivefold)."""
    text = bounded(text, limit)
    pieces, used = [], 0
    for index, character in enumerate(text):
        control = _CARD_CONTROL.match(character)
        if character == ":" and text.startswith("//", index + 1):
            piece = "&#58;"  # no scheme://, so no link made of a tenant's URL
        elif control:
            piece = _escape_control(control).translate(_LARK_MD)
        else:
            piece = character.translate(_LARK_MD)
        if used + len(piece) > limit - (index < len(text) - 1):
            pieces.append(ELLIPSIS)
            break
        pieces.append(piece)
        used += len(piece)
    return "".join(pieces)


class OneLineRecords(logging.Filter):
    """A handler filter: each record's message (its arguments filled in) becomes :func:`one_line`.
    The traceback of a logged exception stays as it is (it is ours, not a tenant's, and a traceback
    is many lines by nature)."""

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            message = record.getMessage()
        except (TypeError, ValueError):  # a bad format string: logging would print its own complaint
            return True
        escaped = one_line(message, LOG_LINE_LIMIT)
        if escaped != message:
            record.msg, record.args = escaped, None
        return True


def one_line_logs(logger: logging.Logger | None = None) -> None:
    """Put :class:`OneLineRecords` on every handler of ``logger`` (the root logger by default), once."""
    for handler in (logger or logging.getLogger()).handlers:
        if not any(isinstance(f, OneLineRecords) for f in handler.filters):
            handler.addFilter(OneLineRecords())
