"""The dumps a real gloo run would have given on NCCL, derived by the rules of PyTorch's FlightRecorder.

No GPU here, so no ProcessGroupNCCL: its dumps are derived from a real gloo run (its dumps and the
journal of groups and sends/receives the job kept) by what FlightRecorder.cpp / FlightRecorderDetail.hpp
record with TORCH_NCCL_ENABLE_TIMING: ``profiling_name`` ``nccl:<op>`` and ``nccl:send <me>-><peer>`` /
``nccl:recv <me><-<peer>`` (group ranks), ``collective_seq_id`` unchanged by send/receive and
``p2p_seq_id`` counting them, ``pg_config`` with each group's ranks, ``pg_status`` per pg id, and per
entry ``state`` completed / started / scheduled from the CUDA events: a kernel starts when its stream
reaches it (the rank's call time: compute is on the host here) and ends when the last member has
joined, so ``duration_ms`` is the GPU time from the rank's own arrival to the last arrival, and the
``time_discovered_*`` stamps are when the watchdog saw the events (a poll interval later). A
collective or exchange some member never joined is "started" and never completes.
"""

from __future__ import annotations

import json
import pickle
from pathlib import Path
from typing import Any

LAST_JOIN_NS = 30_000  # the transfer after the last member joins
POLL_NS = 100_000  # watchdog discovery lag


def _load(path: Path) -> dict[str, Any]:
    raw = path.read_bytes()
    return json.loads(raw) if raw[:1] == b"{" else pickle.loads(raw)


def derive(gloo_dir: Path, out: Path, slow_link: tuple[int, int] | None = None, link_ns: int = 0) -> list[Path]:
    """``slow_link``: two global ranks whose transfers (both directions) take ``link_ns`` longer once
    both sides are ready, as a degraded link between them would."""
    out.mkdir(parents=True, exist_ok=True)
    dumps = {int(p.name.rsplit("_", 1)[1]): _load(p) for p in gloo_dir.glob("nccl_trace_rank_*")}
    journals = {int(p.stem.split("_")[1]): json.loads(p.read_text()) for p in (gloo_dir / "journal").glob("*.json")}
    groups: dict[str, dict[str, Any]] = {}
    for journal in journals.values():
        groups.update(journal["groups"])

    arrivals: dict[tuple[str, int], dict[int, int]] = {}  # (group, seq) -> rank -> call time
    for rank, dump in dumps.items():
        for entry in dump["entries"]:
            arrivals.setdefault((entry["process_group"][0], entry["collective_seq_id"]), {})[rank] = entry[
                "time_created_ns"
            ]
    exchanges: dict[tuple[str, int, int, int], int] = {}  # (group, sender, receiver, n) -> time, both sides
    counts: dict[tuple[int, str, str, int], int] = {}
    keyed_p2p: dict[int, list[tuple[dict[str, Any], tuple[str, int, int, int]]]] = {}
    for rank, journal in journals.items():
        for item in journal["p2p"]:
            ranks = groups[item["group"]]["ranks"]
            me, peer = ranks.index(rank), item["peer"]
            sender, receiver = (me, peer) if item["op"] == "send" else (peer, me)
            counter = (rank, item["group"], item["op"], peer)
            counts[counter] = counts.get(counter, 0) + 1
            key = (item["group"], sender, receiver, counts[counter])
            keyed_p2p.setdefault(rank, []).append((item, key))
            exchanges.setdefault(key, 0)
            exchanges[key] += 1

    written = []
    for rank, dump in dumps.items():
        entries = []
        for entry in dump["entries"]:
            joined = arrivals[(entry["process_group"][0], entry["collective_seq_id"])]
            members = groups[entry["process_group"][0]]["ranks"]
            done = len(joined) == len(members)
            name = entry["profiling_name"].replace("gloo:", "nccl:")
            entries.append(_entry(entry, name, done, max(joined.values())))
        pg_ids = {entry["process_group"][0]: entry["pg_id"] for entry in dump["entries"]}
        for item, key in keyed_p2p.get(rank, []):
            group, sender, receiver, _ = key
            done = exchanges[key] == 2
            partner_time = max(
                (i["t"] for r, items in keyed_p2p.items() if r != rank for i, k in items if k == key), default=item["t"]
            )
            me, peer = (sender, receiver) if item["op"] == "send" else (receiver, sender)
            ranks = groups[group]["ranks"]
            slow = slow_link is not None and {ranks[sender], ranks[receiver]} == set(slow_link)
            arrow = "->" if item["op"] == "send" else "<-"
            stub = {"time_created_ns": item["t"], "process_group": [group, groups[group]["desc"]],
                    "pg_id": pg_ids.get(group, len(pg_ids)), "input_sizes": [[256]], "frames": []}  # fmt: skip
            ready = max(item["t"], partner_time)
            entries.append(_entry(stub, f"nccl:{item['op']} {me}{arrow}{peer}", done, ready, link_ns if slow else 0))
        written.append(_write(out, rank, entries, groups, dump))
    return written


def _entry(entry: dict[str, Any], name: str, done: bool, last_join: int, extra_ns: int = 0) -> dict[str, Any]:
    created = entry["time_created_ns"]
    completed = last_join + LAST_JOIN_NS + extra_ns if done else None
    return {
        "pg_id": entry["pg_id"], "process_group": tuple(entry["process_group"]), "profiling_name": name,
        "collective_seq_id": entry.get("collective_seq_id", 0), "p2p_seq_id": 0, "input_sizes": entry["input_sizes"],
        "input_dtypes": ["Float"], "output_sizes": entry["input_sizes"], "output_dtypes": ["Float"],
        "time_created_ns": created, "time_discovered_started_ns": created + POLL_NS,
        "time_discovered_completed_ns": completed + POLL_NS if completed else None,
        "duration_ms": (completed - created) / 1e6 if completed else None,
        "state": "completed" if completed else "started", "retired": bool(completed), "timeout_ms": 600_000,
        "is_p2p": " " in name, "frames": entry["frames"],
    }  # fmt: skip


def _write(out: Path, rank: int, entries: list[dict[str, Any]], groups: dict[str, Any], gloo: dict[str, Any]) -> Path:
    entries.sort(key=lambda e: e["time_created_ns"])
    collective: dict[str, int] = {}
    p2p: dict[str, int] = {}
    status: dict[str, dict[str, int]] = {}
    for number, entry in enumerate(entries):
        group = entry["process_group"][0]
        entry["record_id"] = entry["op_id"] = number
        if entry["is_p2p"]:
            p2p[group] = p2p.get(group, 0) + 1
            entry["collective_seq_id"], entry["p2p_seq_id"] = collective.get(group, 0), p2p[group]
            continue
        collective[group] = entry["collective_seq_id"]
        pg = status.setdefault(str(entry["pg_id"]), {"last_enqueued_collective": -1, "last_started_collective": -1,
                                                     "last_completed_collective": -1})  # fmt: skip
        pg["last_enqueued_collective"] = pg["last_started_collective"] = entry["collective_seq_id"]
        if entry["state"] == "completed":
            pg["last_completed_collective"] = entry["collective_seq_id"]
    mine = {name: g for name, g in groups.items() if rank in g["ranks"]}
    dump = {
        "version": gloo["version"],
        "comm_lib_version": "2.30.7",
        "pg_config": {name: {"name": name, "desc": g["desc"], "ranks": str(g["ranks"])} for name, g in mine.items()},
        "pg_status": status,
        "entries": entries,
    }
    path = out / f"nccl_trace_rank_{rank}"
    path.write_bytes(pickle.dumps(dump))
    return path
