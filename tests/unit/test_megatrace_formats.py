"""Every line format Megatrace has shipped, read the same by both tokenisers, with file:line errors.

- early (its NCCL patch, and the published sample): ``[save_count N] [s.ns] [Rank R] Fun <Op> Data <n>
  stream <p> opCount <n>``;
- with ``groupHash <int64>`` (the patch later, its intercept branch with ``ncclAllReduce`` names and
  opCount counted per stream from 1);
- bracketed (trace/intercept): optional ``[extra]`` fields, ``[node_ip] [hostname] [save_count N]
  [s.ns] [Rank R] [PCI bus] [Func ncclOp] [Data n] [stream p] [opCount n] [groupHash 0x..]``, one file
  per process named ``<pod>_<time>_<pid>.log`` (rotated to ``.log.1``, ...).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from megatrace_lines import HASH, bracketed

from rankwatch.analysis import megatrace
from rankwatch.analysis.megatrace import MegatraceError, read_logs

NATIVE = megatrace._native


def read_with_each_tokenizer(directory: Path, monkeypatch) -> list:
    results = []
    for native in (NATIVE, None):
        monkeypatch.setattr(megatrace, "_native", native)
        try:
            results.append(read_logs(directory))
        except MegatraceError as error:
            results.append(str(error))
    return results


def test_bracketed_format_with_node_ip_hostname_and_hex_group_hash(tmp_path, monkeypatch):
    (tmp_path / "job-1-worker-0_20260111_120000_4242.log").write_bytes(bracketed(0, range(12)))
    (tmp_path / "job-1-worker-1_20260111_120000_4343.log").write_bytes(
        bracketed(1, range(12), extra="[job-9f34] [0] ", func="Fun", host="node202")
    )
    c_trace, numpy_trace = read_with_each_tokenizer(tmp_path, monkeypatch)
    assert c_trace.calls.tobytes() == numpy_trace.calls.tobytes()
    calls = c_trace.calls
    assert sorted(c_trace.ranks) == [0, 1] and len(calls) == 24
    assert {c_trace.ranks[0].node, c_trace.ranks[1].node} == {"node201", "node202"}
    assert set(calls["comm"].tolist()) == {HASH}, "one communicator on both ranks, from the unsigned hex hash"
    assert set(calls["op"].tolist()) == {int(megatrace.Op.ALLGATHER)}
    assert calls["count"][0] == 33554432 and calls["seq"].min() == 2  # opCount 1 -> seq 2 (opCount counts from 0)
    assert c_trace.problems == []


def test_rotated_files_of_one_process_are_read_together(tmp_path, monkeypatch):
    (tmp_path / "pod_20260111_120000_7.log.1").write_bytes(bracketed(3, range(10)))
    (tmp_path / "pod_20260111_120000_7.log").write_bytes(bracketed(3, range(10, 20)))
    (tmp_path / "notes.log").write_text("not a Megatrace log\n")
    c_trace, numpy_trace = read_with_each_tokenizer(tmp_path, monkeypatch)
    assert c_trace.calls.tobytes() == numpy_trace.calls.tobytes()
    assert list(c_trace.ranks) == [3] and len(c_trace.calls) == 20
    assert np.all(np.diff(c_trace.calls["t_call"]) > 0)


@pytest.mark.parametrize(
    "bad, expected",
    [
        (
            b"[10.0.0.1] [node] [save_count 1] [1768121799.5] [Rank 0] [PCI x] [Func ncclAllGather]\n",
            ":4: not a Megatrace line",
        ),
        (bracketed(0, range(1)).replace(b"ncclAllGather", b"ncclTeleport"), ":4: unknown operation 'ncclTeleport'"),
        (bracketed(0, range(1)).replace(b"[Data 33554432]", b"[Data many]"), ":4: not a Megatrace line"),
    ],
)
def test_a_bad_bracketed_line_is_named_by_file_and_line(tmp_path, monkeypatch, bad, expected):
    path = tmp_path / "pod_1_2.log"
    path.write_bytes(bracketed(0, range(3)) + bad + bracketed(0, range(3, 5)))
    for result in read_with_each_tokenizer(tmp_path, monkeypatch):
        assert isinstance(result, str) or result.problems, result
        text = result if isinstance(result, str) else "\n".join(result.problems)
        assert f"{path}{expected}" in text


def test_intercept_branch_names_with_nccl_prefix(tmp_path, monkeypatch):
    lines = b"".join(
        b"[save_count 1] [1700000000.%09d] [Rank 0] Fun %s Data 8 stream 0x55 opCount %d groupHash -59562859790\n"
        % (i, name, i + 1)
        for i, name in enumerate([b"ncclAllReduce", b"ncclSendRecv", b"ncclSend", b"ncclRecv", b"ncclBroadcast"])
    )
    (tmp_path / "rank_0.log").write_bytes(lines)
    c_trace, numpy_trace = read_with_each_tokenizer(tmp_path, monkeypatch)
    assert c_trace.calls.tobytes() == numpy_trace.calls.tobytes()
    ops = [megatrace.Op(int(op)).name for op in c_trace.calls["op"]]
    assert ops == ["ALLREDUCE", "SEND", "SEND", "RECV", "BROADCAST"]
