"""The local Feishu (tests/alerting/fake_feishu.py) for synchronous e2e tests: the operator's pages land here."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

from alerting_support import BOT_TOKEN, SIGNING_SECRET
from fake_feishu import FakeFeishu


class Feishu:
    """The local Feishu on a loop of its own (the test is synchronous)."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, daemon=True).start()
        self.fake = FakeFeishu()
        self._run(self.fake.start())
        self.fake.add_bot(BOT_TOKEN, SIGNING_SECRET)

    def _run(self, coroutine: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(30)

    def pages(self, alertname: str) -> list[str]:
        titles = [card["header"]["title"]["content"] for card in self.fake.cards()]
        return [title for title in titles if alertname in title and not title.startswith("[Resolved]")]

    def stop(self) -> None:
        self._run(self.fake.stop())
        self.loop.call_soon_threadsafe(self.loop.stop)
