"""Megatron layout: coordinates, group kinds, Megatrace's config.yaml."""

from __future__ import annotations

import pytest

from rankwatch.analysis.topology import Layout, LayoutError, load_config


def test_megatron_order_tp_fastest_then_dp_then_pp():
    layout = Layout(tp=4, pp=2, world_size=32)
    assert layout.dp == 4
    assert layout.coords(0) == (0, 0, 0)
    assert layout.coords(13) == (1, 3, 0)
    assert layout.coords(17) == (1, 0, 1)
    assert layout.describe(13) == "tp 1, dp 3, pp 0"


def test_group_kinds_from_membership():
    layout = Layout(tp=2, pp=2, world_size=8)
    assert layout.group_kind({0, 1}) == "TP"
    assert layout.group_kind({1, 3}) == "DP"
    assert layout.group_kind({1, 5}) == "PP"
    assert layout.group_kind(set(range(8))) == "world"
    assert layout.group_kind({0, 3}) == "mixed"


def test_layout_that_does_not_divide_is_refused():
    with pytest.raises(LayoutError, match="TP 3 x PP 1 must divide world_size 8"):
        Layout(3, 1, 8)


def test_megatrace_config_yaml(tmp_path):
    (tmp_path / "config.yaml").write_text("TP: 8\nPP: 4\nworld_size: 64\n")
    assert load_config(tmp_path / "config.yaml") == Layout(8, 4, 64)
    (tmp_path / "bad.yaml").write_text("TP: 8\n")
    with pytest.raises(LayoutError, match="missing PP, world_size"):
        load_config(tmp_path / "bad.yaml")
    (tmp_path / "text.yaml").write_text("TP: eight\nPP: 1\nworld_size: 8\n")
    with pytest.raises(LayoutError, match="must be integers"):
        load_config(tmp_path / "text.yaml")
