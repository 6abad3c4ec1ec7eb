"""Megatrace log lines in the bracketed (trace/intercept) format, as its writer prints them."""

from __future__ import annotations

HASH = 0x8E5988B6AEA85FA7  # above 2**63: the bracketed format writes it unsigned, in hex


def bracketed(rank: int, calls: range, extra: str = "", func: str = "Func", host: str = "node201") -> bytes:
    text = ""
    for i in calls:
        text += (
            f"{extra}[10.254.1.{rank + 1}] [{host}] [save_count {1 + i // 10}] [1768121799.{i * 1000 + rank:09d}] "
            f"[Rank {rank}] [PCI 0000:18:00.0] [{func} ncclAllGather] [Data 33554432] [stream (nil)] "
            f"[opCount {i + 1}] [groupHash 0x{HASH:016x}]\n"
        )
    return text.encode()
