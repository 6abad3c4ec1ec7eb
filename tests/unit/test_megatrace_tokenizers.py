"""The C Megatrace tokeniser and the numpy one (its fallback) give the same traces and the same
errors, on crafted logs and on randomly damaged ones."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest

from rankwatch.analysis import megatrace
from rankwatch.analysis.megatrace import read_logs

NATIVE = megatrace._native


def test_the_c_tokenizer_is_built():
    assert NATIVE is not None, "rankwatch.analysis._megatrace_tokenizer did not build (gcc, Python headers?)"
    assert megatrace.tokenizer() == "C"


def _both(directory: Path, monkeypatch) -> tuple:
    """read_logs with each tokeniser: (C, numpy), as comparable values (or the exception raised)."""
    results = []
    for native in (NATIVE, None):
        monkeypatch.setattr(megatrace, "_native", native)
        try:
            trace = read_logs(directory)
        except Exception as error:  # compared, not hidden
            results.append((type(error).__name__, str(error)))
            continue
        comms = {key: (c.id, c.size, c.members, c.parent) for key, c in trace.comms.items()}
        results.append(
            (trace.calls.dtype, trace.calls.tobytes(), list(trace.ranks.items()), list(comms.items()), trace.problems)
        )
    return tuple(results)


def _write(directory: Path, files: dict[str, bytes]) -> Path:
    for name, data in files.items():
        (directory / name).write_bytes(data)
    return directory


def _lines(rank: int, calls: range, *, save_count: int = 1, old: bool = False, ns: int = 1000) -> bytes:
    ops = ("AllReduce", "allgather", "REDUCESCATTER", "Send", "Recv", "Broadcast", "bcast", "Reduce", "AlltoAll")
    text = ""
    for i in calls:
        text += f"[save_count {save_count}] [1700000000.{i * ns % 10**9:09d}] [Rank {rank}] Fun {ops[i % len(ops)]} "
        text += f"Data {1024 + i % 7} stream 0x7f3a2c00{i % 3:04x} opCount {i}"
        text += "\n" if old else f" groupHash {-(10**18) + i % 4}\n"
    return text.encode()


GOOD = _lines(0, range(3))
CASES = {
    "several dumps, overlapping": _lines(0, range(50)) + _lines(0, range(30, 90), save_count=2),
    "ring wrapped: a later dump lost the oldest calls": _lines(0, range(0, 40))
    + _lines(0, range(25, 60), save_count=2),
    "older format, streams": _lines(0, range(20), old=True) + _lines(0, range(10, 30), save_count=2, old=True),
    "both formats in one file": _lines(0, range(10)) + _lines(0, range(10, 20), old=True),
    "times out of order": _lines(0, range(20), ns=7 * 10**8 + 1),
    "calls at the same time": _lines(0, range(6), ns=0) + _lines(0, range(4, 9), ns=0, save_count=2),
    "a repeat after times went back": _lines(0, range(10)) + _lines(0, range(5), ns=3) + _lines(0, range(8, 12)),
    "CRLF": GOOD.replace(b"\n", b"\r\n"),
    "trailing spaces and tabs": GOOD.replace(b"\n", b" \t \n"),
    "blank lines": b"\n\n" + GOOD.replace(b"\n", b"\n\n \n"),
    "several spaces between fields": GOOD.replace(b"] [", b"]  \t [").replace(b" Data ", b"   Data "),
    "no newline at the end": GOOD.rstrip(b"\n"),
    "empty file": b"",
    "a line with leading spaces joins the line before": GOOD + b"  " + GOOD,
    "a line with leading spaces at the start": b"  " + GOOD,
    "shortest tokens at the very start": b"[ 1] [0.000000000] [ 0] F Send D 0 s 0 o 0\n",
    "0x pointers only int() accepts": _lines(0, range(3), old=True).replace(b"0x7f3a2c000001", b"0x7f_3a"),
    "0x pointer of 17 digits, leading zero": _lines(0, range(3), old=True).replace(
        b"0x7f3a2c000001", b"0x0" + b"f" * 16
    ),
    "(nil) and decimal streams": _lines(0, range(3), old=True).replace(b"0x7f3a2c000001", b"(nil)"),
    "numbers wrap at 64 bits": GOOD.replace(b"Data 1024", b"Data 123456789012345678901234567890"),
    "groupHash '-' alone": GOOD.replace(b"groupHash -999999999999999999", b"groupHash -"),
    "rank beyond 32 bits": GOOD.replace(b"Rank 0", b"Rank 4294967297"),
    "empty rank digits": GOOD.replace(b"Rank 0]", b"Rank ]"),
    "garbage line": GOOD + b"garbage in the middle\n" + GOOD,
    "a line with a token too many": GOOD + GOOD.splitlines()[0] + b" extra\n",
    "a wrong letter, then a wrong token count": GOOD.replace(b"Fun", b"fun", 1) + b"x y\n",
    "unknown operation": GOOD.replace(b"allgather", b"Teleport"),
    "operation matched on length and three letters": GOOD.replace(b"allgather", b"aXXgZZZZr"),
    "a letter in a number": GOOD.replace(b"Data 1025", b"Data 10x5"),
    "a bad number before an unknown operation": GOOD.replace(b"allgather", b"Teleport").replace(
        b"opCount 2", b"opCount z"
    ),
    "negative rank": GOOD.replace(b"Rank 0", b"Rank -1"),
    "short time": GOOD.replace(b"1700000000.000001000", b"1.5"),
    "time without seconds": GOOD.replace(b"1700000000.000001000", b"x.000001000"),
    "bad groupHash": GOOD.replace(b"groupHash -999999999999999998", b"groupHash 12x"),
    "bad 0x pointer": _lines(0, range(3), old=True).replace(b"0x7f3a2c000001", b"0xZZ"),
    "0x pointer beyond 64 bits": _lines(0, range(3), old=True).replace(b"0x7f3a2c000001", b"0x1" + b"0" * 16),
}


@pytest.mark.parametrize("name", CASES)
def test_c_and_numpy_tokenizers_agree(tmp_path, monkeypatch, name):
    _write(tmp_path, {"rank_0.log": CASES[name], "rank_1.log": _lines(1, range(5))})
    c_result, numpy_result = _both(tmp_path, monkeypatch)
    assert c_result == numpy_result


@pytest.mark.parametrize("size", [447, 448, 449, 511, 512, 513])
def test_a_last_line_without_newline_ending_at_a_64_byte_boundary(tmp_path, monkeypatch, size):
    head, last = _lines(0, range(1, 3)), _lines(0, range(1)).rstrip(b"\n")
    zeros = b"0" * (size - len(head) - len(last))  # leading zeros: the same call
    text = head + last.replace(b"opCount 0", b"opCount " + zeros + b"0")
    assert len(text) == size
    _write(tmp_path, {"rank_0.log": text})
    c_result, numpy_result = _both(tmp_path, monkeypatch)
    assert c_result == numpy_result
    assert len(c_result) == 5 and not c_result[4] and len(c_result[1]) == 3 * megatrace.CALL_DTYPE.itemsize


def _mutated(rng: random.Random) -> bytes:
    rank = rng.choice([0, 7, 2**31 + 1])
    text = _lines(rank, range(rng.randrange(40)), old=rng.random() < 0.3, ns=rng.choice([1000, 7 * 10**8 + 1]))
    text += _lines(rank, range(rng.randrange(30), rng.randrange(30, 60)), save_count=2)
    for _ in range(rng.choice([0, 1, 1, 2, 4])):
        if not text:
            break
        at = rng.randrange(len(text))
        byte = bytes([rng.choice(b" \t\r\n-x0123456789[]FDsoabc_.\x0b")])
        text = rng.choice([text[:at] + byte + text[at + 1 :], text[:at] + text[at + 1 :], text[:at] + byte + text[at:]])
    return text


def test_c_and_numpy_tokenizers_agree_on_damaged_logs(tmp_path, monkeypatch):
    rng = random.Random(20261122)
    for case in range(150):
        directory = tmp_path / str(case)
        directory.mkdir()
        _write(directory, {f"rank_{k}.log": _mutated(rng) for k in range(rng.randrange(1, 4))})
        c_result, numpy_result = _both(directory, monkeypatch)
        assert c_result == numpy_result, f"case {case}: {sorted(p.name for p in directory.iterdir())}"


def test_a_file_that_grows_while_read(tmp_path, monkeypatch):
    text = _lines(0, range(200))
    _write(tmp_path, {"rank_0.log": text})
    expected = read_logs(tmp_path).calls.tobytes()
    real_fstat = megatrace.os.fstat
    monkeypatch.setattr(megatrace.os, "fstat", lambda fd: type("Stat", (), {"st_size": real_fstat(fd).st_size // 3}))
    assert read_logs(tmp_path).calls.tobytes() == expected


def test_many_files_keep_their_order_of_problems_and_ranks(tmp_path):
    files = {f"rank_{r}.log": _lines(r, range(20)) for r in range(12)}
    files["rank_3.log"] += b"bad\n"
    files["rank_10.log"] = files["rank_10.log"].replace(b"Send", b"Sling")
    trace = read_logs(_write(tmp_path, files))
    assert [Path(p.split(":")[0]).name for p in trace.problems] == ["rank_10.log", "rank_3.log"]
    assert list(trace.ranks) == [0, 1, 11, 2, 4, 5, 6, 7, 8, 9]  # file name order
    assert (np.diff(trace.calls["rank"]) >= 0).all() and len(trace.calls) == 200


@pytest.mark.parametrize(
    "rank",
    ["2147483648", "3000000000", "4294967295", "4294967296", "4294967297", "18446744073709551617", "9" * 40],
)
def test_a_rank_beyond_32_bits_is_refused_with_its_line_never_wrapped(tmp_path, monkeypatch, rank):
    """A rank id NCCL cannot have (above 2^31 - 1) used to wrap to a negative or a small rank (4294967297
    read as rank 1, the analysis then blamed rank 1): both tokenisers now name the file and line."""
    bad = _lines(0, range(3)).splitlines(keepends=True)
    bad[1] = bad[1].replace(b"Rank 0", f"Rank {rank}".encode())
    _write(tmp_path, {"rank_0.log": b"".join(bad), "rank_1.log": _lines(1, range(5))})
    c_result, numpy_result = _both(tmp_path, monkeypatch)
    assert c_result == numpy_result
    trace = read_logs(tmp_path)
    assert trace.ranks.keys() == {1} and set(trace.calls["rank"].tolist()) == {1}
    assert trace.problems == [
        f"{tmp_path / 'rank_0.log'}:2: rank {rank[:40]} does not fit in 32 bits (an NCCL rank is at most 2147483647)"
    ]


def test_the_largest_32_bit_rank_is_read_as_itself_then_left_out_of_the_analysis(tmp_path):
    _write(tmp_path, {"rank_0.log": _lines(2**31 - 1, range(3)), "rank_1.log": _lines(1, range(5))})
    trace = read_logs(tmp_path)
    assert trace.problems == [
        f"{tmp_path / 'rank_0.log'}: rank 2147483647 is beyond the highest analysed ({megatrace.MAX_GLOBAL_RANK}); "
        "skipped"
    ]
