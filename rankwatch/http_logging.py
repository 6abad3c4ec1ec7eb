"""One line, not a traceback, for a client's malformed HTTP.

aiohttp logs every request it cannot parse (a bad header, an unknown Content-Encoding, a line too
long) with a full traceback at ERROR on ``aiohttp.server``: the client already got its 400, and a
stranger sending garbage at a high rate would fill the log. Such records become one WARNING line,
at most one per ``interval_s`` (with the count of the ones folded into it); every other record of that
logger (our own bugs included) passes unchanged.
"""

from __future__ import annotations

import logging
import time

from aiohttp.http_exceptions import HttpProcessingError


class ClientErrorsInOneLine(logging.Filter):
    def __init__(self, interval_s: float = 10.0) -> None:
        super().__init__()
        self.interval_s = interval_s
        self._last = -interval_s
        self._folded = 0

    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        if not isinstance(error, HttpProcessingError):
            return True
        now = time.monotonic()
        if now - self._last < self.interval_s:
            self._folded += 1
            return False
        folded, self._folded, self._last = self._folded, 0, now
        message = str(error).replace("\n", " ").strip()[:200]
        record.msg = "malformed HTTP from %s refused with %s: %s%s"
        record.args = (*(record.args or ("?",))[:1], getattr(error, "code", 400), message,
                       f" ({folded} more since the last such line)" if folded else "")  # fmt: skip
        record.exc_info, record.exc_text, record.levelno, record.levelname = None, None, logging.WARNING, "WARNING"
        return True


_installed = False


def quiet_client_errors() -> None:
    """Install the filter on aiohttp's server logger (once per process)."""
    global _installed
    if not _installed:
        logging.getLogger("aiohttp.server").addFilter(ClientErrorsInOneLine())
        _installed = True
