"""Sends met with their receives (slow links): by the keys alone, whatever their bits."""

from __future__ import annotations

import numpy as np

from rankwatch.analysis.slow_link import _match

MIX = 0x9E3779B97F4A7C15  # what the match multiplies keys by before sorting their high bits


def _keys_alike_in_high_bits(count: int, rng: np.random.Generator) -> np.ndarray:
    """Distinct keys whose mixed values share their high bits: the collisions a sort of the high bits meets."""
    high = int(rng.integers(1 << 40)) << 24
    mixed = [high | int(low) for low in rng.choice(1 << 24, count, replace=False)]
    inverse = pow(MIX, -1, 1 << 64)
    return np.array([value * inverse % (1 << 64) for value in mixed], np.uint64)


def _expected(keys: np.ndarray, sends: int) -> list[tuple[int, int]]:
    where = {}
    for index, key in enumerate(keys.tolist()):
        where.setdefault(key, []).append(index)
    return sorted((a, b - sends) for a, b in (v for v in where.values() if len(v) == 2) if a < sends <= b)


def test_every_send_meets_its_own_receive_when_high_bits_collide():
    rng = np.random.default_rng(5)
    crowd = _keys_alike_in_high_bits(40, rng)  # 20 transfers whose keys differ in their low bits only
    plain = rng.integers(0, 2**63, 5_000, dtype=np.uint64)
    unmatched = rng.integers(0, 2**63, 300, dtype=np.uint64)
    send_keys = np.r_[crowd[:20], plain, unmatched[:150], crowd[20:30]]  # crowd[20:30] sent, never received
    recv_keys = rng.permutation(np.r_[crowd[:20], plain, unmatched[150:]])
    keys = np.r_[send_keys, recv_keys]
    send_index, recv_index = _match(keys.copy(), len(send_keys))
    assert sorted(zip(send_index.tolist(), recv_index.tolist(), strict=True)) == _expected(keys, len(send_keys))
    assert np.array_equal(send_index, np.sort(send_index))  # in the sends' order
    assert len(send_index) == 20 + len(plain)


def test_a_key_three_times_still_pairs_equal_keys_once_each():
    rng = np.random.default_rng(6)
    plain = rng.integers(0, 2**63, 2_000, dtype=np.uint64)
    keys = np.r_[plain, plain[:1], rng.permutation(plain)]  # the first key sent twice
    send_index, recv_index = _match(keys.copy(), len(plain) + 1)
    assert len(send_index) >= len(plain) - 1
    assert np.array_equal(keys[send_index], keys[len(plain) + 1 + recv_index])
    assert len(set(send_index.tolist())) == len(send_index) and len(set(recv_index.tolist())) == len(recv_index)
    assert 0 in send_index and len(plain) not in send_index, "the first send of the key meets its one receive"
