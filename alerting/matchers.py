"""Alertmanager label matchers: ``name="value"``, ``name!="value"``, ``name=~"regex"``, ``name!~"regex"``.

Routes, inhibition rules and silences all select alerts with these, so there is one parser and one
meaning (regexes are anchored, a missing label is the empty string), as in Alertmanager.

Regular expressions are RE2's (google-re2), as Alertmanager's (Go's regexp) are: matching takes time
linear in the label's length whatever the pattern, so a silence posted to the intake cannot stall the
pipeline with catastrophic backtracking. What RE2 does not have (backreferences, lookaround) is refused
with the reason, and so are patterns longer than :data:`MAX_PATTERN_CHARS` or needing more than
:data:`MAX_PROGRAM_BYTES` to compile.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import re2

_MATCHER = re.compile(r"^\s*([A-Za-z_][A-Za-z0-9_]*)\s*(=~|!~|!=|=)\s*(.*?)\s*$")
OPERATORS = ("=", "!=", "=~", "!~")
MAX_PATTERN_CHARS = 1024
"""Longest regular expression a matcher takes (Alertmanager's own are label patterns, a few dozen)."""
MAX_PROGRAM_BYTES = 1 << 20
"""Memory RE2 may use for one compiled pattern (its default is 8 MiB)."""


def _re2_options() -> re2.Options:
    options = re2.Options()
    options.log_errors = False  # the refusal names the problem; no C++ log line on stderr
    options.max_mem = MAX_PROGRAM_BYTES
    return options


_OPTIONS = _re2_options()


class MatcherError(ValueError):
    """A matcher string that cannot be parsed; the message says what a valid one looks like."""


@dataclass(frozen=True)
class Matcher:
    name: str
    op: str
    value: str

    def __post_init__(self) -> None:
        if self.op in ("=~", "!~"):
            if len(self.value) > MAX_PATTERN_CHARS:
                raise MatcherError(
                    f"{self.name}{self.op}...: bad regular expression: {len(self.value)} characters, "
                    f"the limit is {MAX_PATTERN_CHARS}"
                )
            try:
                object.__setattr__(self, "_regex", re2.compile(f"(?:{self.value})", _OPTIONS))
            except re2.error as error:
                reason = (
                    error.args[0].decode(errors="replace") if error.args and isinstance(error.args[0], bytes) else error
                )
                raise MatcherError(
                    f"{self}: bad regular expression: {reason} (RE2 syntax, as Alertmanager's: no backreferences "
                    f"or lookaround, repetition counts up to 1000, at most {MAX_PROGRAM_BYTES >> 20} MiB compiled)"
                ) from None

    @classmethod
    def parse(cls, text: str) -> Matcher:
        if not isinstance(text, str):
            raise MatcherError(f"expected a string like 'level=\"P0\"', got {text!r}")
        found = _MATCHER.match(text)
        if not found:
            raise MatcherError(f'cannot parse {text!r}: write name="value" (operators =, !=, =~, !~)')
        name, op, raw = found.groups()
        if raw.startswith('"'):
            if len(raw) < 2 or not raw.endswith('"'):
                raise MatcherError(f"cannot parse {text!r}: unterminated quoted value")
            try:
                value = json.loads(raw)
            except json.JSONDecodeError:
                raise MatcherError(f"cannot parse {text!r}: bad escape in quoted value") from None
        else:
            value = raw
        return cls(name, op, value)

    def matches(self, labels: Mapping[str, str]) -> bool:
        value = labels.get(self.name, "")
        if self.op == "=":
            return value == self.value
        if self.op == "!=":
            return value != self.value
        hit = self._regex.fullmatch(value) is not None  # type: ignore[attr-defined]
        return hit if self.op == "=~" else not hit

    def __str__(self) -> str:
        return f"{self.name}{self.op}{json.dumps(self.value, ensure_ascii=False)}"


def matches_all(matchers: Iterable[Matcher], labels: Mapping[str, str]) -> bool:
    return all(matcher.matches(labels) for matcher in matchers)
