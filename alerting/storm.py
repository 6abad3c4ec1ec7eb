"""Storm control: past ``max_alerts`` alerts to one receiver in a window, hold the rest for one summary.

A node failure can raise hundreds of alerts at once; a chat with hundreds of cards (or a phone
ringing hundreds of times) hides the one that matters. Once a window's budget is spent, every
further notification to that receiver in the window is held (including later small ones, so the
order people read is kept) and told as one summary when the window ends.
"""

from __future__ import annotations

from rankwatch.alerting.config import StormConfig
from rankwatch.alerting.messages import Notification, StormSummary


class StormGate:
    def __init__(self, receiver: str, config: StormConfig) -> None:
        self.receiver = receiver
        self.config = config
        self.window_start: float | None = None
        self.count = 0
        self.held: dict[str, Notification] = {}
        self.summarised: set[str] = set()  # groups of a summary still being delivered

    def admit(self, notification: Notification, now: float) -> bool:
        """True: send it now. False: held for the summary (a newer one for the same group replaces it)."""
        if self.window_start is None or (not self.held and now >= self.window_start + self.config.window):
            self.window_start, self.count = now, 0
        size = len(notification.alerts)
        if not self.held and self.count + size <= self.config.max_alerts:
            self.count += size
            return True
        self.held[notification.group_key] = notification
        return False

    def is_held(self, group_key: str) -> bool:
        return group_key in self.held

    def is_summarised(self, group_key: str) -> bool:
        """In a summary on its way: a flush of the group meanwhile would tell it twice (its delivery
        records the group as told, and the group's next flush sees that)."""
        return group_key in self.summarised

    def summary_sent(self, summary: StormSummary) -> None:
        self.summarised.difference_update(n.group_key for n in summary.notifications)

    def summary_due(self, now: float) -> StormSummary | None:
        """The summary once the window is over (and the gate reset), else None."""
        if not self.held or self.window_start is None or now < self.window_start + self.config.window:
            return None
        summary = StormSummary(self.receiver, self.window_start, now, tuple(self.held.values()))
        self.summarised.update(self.held)
        self.held, self.window_start, self.count = {}, None, 0
        return summary
