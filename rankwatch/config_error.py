"""The one error for settings that cannot be used: the operator's environment, the sidecar's flags and
variables, the alerting config. Each problem names its variable, flag or field and what is expected."""

from __future__ import annotations

from collections.abc import Sequence


class ConfigError(ValueError):
    def __init__(self, problems: str | Sequence[str]) -> None:
        self.problems = [problems] if isinstance(problems, str) else list(problems)
        if isinstance(problems, str):
            super().__init__(problems)
        else:
            super().__init__("bad configuration:\n  " + "\n  ".join(self.problems))
