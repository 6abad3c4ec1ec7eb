"""Alertmanager label matchers: ``name="value"``, ``name!="value"``, ``name=~"regex"``, ``name!~"regex"``.

Routes, inhibition rules and silences all select alerts with these, so there is one parser and one
meaning (regexes are anchored, a missing label is the empty string), as in Alertmanager.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

_MATCHER = re.compile(r"^\s*([A-Za-z_][A-Za-z0-9_]*)\s*(=~|!~|!=|=)\s*(.*?)\s*$")
OPERATORS = ("=", "!=", "=~", "!~")


class MatcherError(ValueError):
    """A matcher string that cannot be parsed; the message says what a valid one looks like."""


@dataclass(frozen=True)
class Matcher:
    name: str
    op: str
    value: str

    def __post_init__(self) -> None:
        if self.op in ("=~", "!~"):
            try:
                object.__setattr__(self, "_regex", re.compile(f"(?:{self.value})\\Z"))
            except re.error as error:
                raise MatcherError(f"{self}: bad regular expression: {error}") from None

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
        hit = self._regex.match(value) is not None  # type: ignore[attr-defined]
        return hit if self.op == "=~" else not hit

    def __str__(self) -> str:
        return f"{self.name}{self.op}{json.dumps(self.value, ensure_ascii=False)}"


def matches_all(matchers: Iterable[Matcher], labels: Mapping[str, str]) -> bool:
    return all(matcher.matches(labels) for matcher in matchers)
