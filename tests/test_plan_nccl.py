"""The cross-node model (vit_pure/plan/nccl.py, fabrics.py) against published nccl-tests
tables, and the one-collective command (vit_pure/tools/price_collective.py).

The tables, with their sources, are vit_pure/plan/measurements/nccl_all_reduce.json:
H100, 8 a node, all_reduce_perf out-of-place, algorithm not forced. Nothing is fitted here:
each point is priced with the fabric's profile as the plan uses it, and

* every point on 2 to 8 nodes is within 30% (InfiniBand on 4 and 8 nodes, EFA on 2, 4
  and 8, TCPXO on 2), the two-node TCPXO run (the curve the kit used to fit) within 25%;
* LEFT OUT of the 30% claim: EFA on 16 and 32 nodes (github.com/crazyguitar/
  aws-gpu-communication-benchmark). Four to eight times the node counts its profile was
  fitted on, the model is up to 1.75x optimistic for 64 MiB-1 GiB calls there (its tree
  latency grows with log2 of the nodes; the measured mid-size cost grows faster); the test
  holds those points to model / measured in (0.5, 1.3), and docs/planning.md lists them.

Pure arithmetic: the whole file runs in well under a second of CPU.
"""
from __future__ import annotations

import dataclasses
import json
import pathlib

import pytest

from vit_pure.plan import fabrics, nccl
from vit_pure.plan import interconnect as ic
from vit_pure.run import cli
from vit_pure.tools import price_collective as collective

MiB, GiB = 2**20, 2**30
DATA = pathlib.Path(nccl.__file__).parent / "measurements" / "nccl_all_reduce.json"
TABLES = json.loads(DATA.read_text())["tables"]
H100 = ic.HARDWARE["h100"]


def _points():
    for t in TABLES:
        for q in t["points"]:
            seconds = (q["time_us"] * 1e-6 if "time_us" in q
                       else q["bytes"] / (q["algbw_gbps"] * 1e9))
            yield pytest.param(t, q, seconds, id=f"{t['id']}-{q['bytes'] // MiB}MiB")


def _predict(table: dict, size: float, algorithm: str = nccl.AUTO) -> nccl.Cost:
    hw = dataclasses.replace(H100, fabric=fabrics.FABRICS[table["fabric"]])
    where = ic.Placement(table["nodes"] * table["gpus_per_node"], table["nodes"])
    return nccl.best_cost(ic.ALL_REDUCE, size, where, hw, algorithm)


# ---------------------------------------------------------------- the published tables
def test_every_table_is_cited_and_covers_two_fabrics_on_4_and_8_nodes():
    for t in TABLES:
        assert t["source"]["where"] and t["source"]["cluster"] and t["source"]["algorithm"]
        assert t["role"] in ("fit", "check") and t["fabric"] in fabrics.FABRICS
    both = {t["fabric"] for t in TABLES if t["nodes"] == 4} & \
        {t["fabric"] for t in TABLES if t["nodes"] == 8}
    assert len(both) >= 2
    # A table the model is checked on, not fitted to, at 8 nodes for each of them.
    assert {t["fabric"] for t in TABLES if t["nodes"] == 8 and t["role"] == "check"} >= both


@pytest.mark.parametrize("table, point, seconds", list(_points()))
def test_model_against_published_all_reduce(table, point, seconds):
    if "busbw_gbps" in point:  # the table is read right: nccl-tests' busbw from its algbw
        n = table["nodes"] * table["gpus_per_node"]
        assert point["algbw_gbps"] * 2 * (n - 1) / n == pytest.approx(point["busbw_gbps"],
                                                                      rel=5e-3)
    ratio = _predict(table, point["bytes"]).seconds(point["bytes"]) / seconds
    if table["nodes"] > 8:  # left out of the 30% claim (module docstring)
        assert 0.5 < ratio < 1.3
    elif table["id"] == "tcpxo-2n":
        assert ratio == pytest.approx(1.0, abs=0.25)
    else:
        assert ratio == pytest.approx(1.0, abs=0.30)


def test_two_node_small_message_latency():
    # The same 16-H100 A3 Mega run: 123-136 us for every size up to 512 B.
    t = next(t for t in TABLES if t["id"] == "tcpxo-2n")
    assert 123e-6 * 0.75 < _predict(t, 512).seconds(512) < 136e-6 * 1.25


# --------------------------------------------------------------- algorithms as NCCL's
def test_algorithm_choice_follows_scale_and_size():
    ib = H100
    inside, two, many = ic.Placement(8, 1), ic.Placement(16, 2), ic.Placement(1024, 128)
    assert nccl.best_cost(ic.ALL_REDUCE, 1 * GiB, inside, ib).algorithm == nccl.NVLS
    assert nccl.best_cost(ic.ALL_GATHER, 1 * GiB, inside, ib).algorithm == nccl.RING
    assert nccl.best_cost(ic.ALL_REDUCE, 32 * MiB, two, ib).algorithm == nccl.NVLS_TREE
    assert nccl.best_cost(ic.ALL_GATHER, 32 * MiB, two, ib).algorithm == nccl.RING
    # At 128 nodes a small call: the tree's log2 latency against the ring's linear one.
    ring = nccl.call_cost(ic.ALL_REDUCE, 1 * MiB, many, ib, nccl.RING)
    tree = nccl.call_cost(ic.ALL_REDUCE, 1 * MiB, many, ib, nccl.NVLS_TREE)
    assert ring.latency == pytest.approx(66e-6 + 2 * (127 * 11e-6 + 896 * nccl.NVLINK_HOP))
    assert tree.latency == pytest.approx(66e-6 + 2 * 7 * 11e-6 + 2 * nccl.NVLINK_HOP)
    assert nccl.best_cost(ic.ALL_REDUCE, 1 * MiB, many, ib).algorithm == nccl.NVLS_TREE
    # Forced, as NCCL_ALGO: ring stays ring; tree on NVSwitch nodes may be NVLS-tree.
    assert nccl.best_cost(ic.ALL_REDUCE, 1 * MiB, many, ib, nccl.RING).algorithm == nccl.RING
    assert nccl.best_cost(ic.ALL_REDUCE, 1 * MiB, many, ib, nccl.TREE).algorithm in (
        nccl.TREE, nccl.NVLS_TREE)
    # No NVSwitch (A100): no NVLS.
    a100 = ic.HARDWARE["a100"]
    assert nccl.candidates(ic.ALL_REDUCE, two, a100) == (nccl.RING, nccl.TREE)


def test_two_node_tree_moves_half_a_rings_network_bytes():
    """Across two nodes each node sends S once (one tree edge); from three on, 2S, as a
    ring: so a 2-node all-reduce's busbw can exceed the NICs' (the EFA 2-node run's 478
    GB/s busbw over 400 GB/s of NICs a node), and from 4 nodes on it cannot."""
    hw = dataclasses.replace(H100, intra=dataclasses.replace(H100.intra, all_reduce_peak=1e15))
    big = 64 * GiB
    two = nccl.call_cost(ic.ALL_REDUCE, big, ic.Placement(16, 2), hw, nccl.NVLS_TREE)
    four = nccl.call_cost(ic.ALL_REDUCE, big, ic.Placement(32, 4), hw, nccl.NVLS_TREE)
    assert four.seconds_per_byte / two.seconds_per_byte == pytest.approx(2.0, rel=0.02)


def test_overrides_set_the_fabric():
    fast = ic.with_overrides(H100, inter_gbps=92.0)
    assert fast.fabric.nic == 92e9 and fast.fabric.half == H100.fabric.half
    slow = ic.with_overrides(H100, latency_us=100.0)
    assert slow.fabric.base + 2 * slow.fabric.hop == pytest.approx(100e-6)
    efa = ic.with_overrides(H100, fabric="efa-p5")
    assert efa.fabric == fabrics.EFA_P5
    where = ic.Placement(64, 8)
    t_ib = nccl.best_cost(ic.ALL_REDUCE, 32 * MiB, where, H100).seconds(32 * MiB)
    t_efa = nccl.best_cost(ic.ALL_REDUCE, 32 * MiB, where, efa).seconds(32 * MiB)
    assert t_efa > t_ib  # EFA's calls cost more at mid sizes (its published runs)


def test_plan_flags_name_every_fabric():
    parser = cli.doc_parser("x")
    cli.add_plan_flags(parser)
    help_text = " ".join(parser.format_help().split())
    for name in fabrics.FABRICS:
        assert name in help_text


# ------------------------------------------------------------------------- the command
def test_command_prices_one_collective(capsys):
    argv = ["--op", "all-reduce", "--size", "32MiB", "--nodes", "8", "--gpus-per-node",
            "8", "--hardware", "h100", "--json"]
    assert collective.main(argv) == 0
    out = json.loads(capsys.readouterr().out.strip())
    cost = nccl.best_cost(ic.ALL_REDUCE, 32 * MiB, ic.Placement(64, 8), H100)
    assert out == {"seconds": pytest.approx(cost.seconds(32 * MiB)),
                   "busbw_gbps": pytest.approx(32 * MiB / cost.seconds(32 * MiB)
                                               * 2 * 63 / 64 / 1e9),
                   "algorithm": cost.algorithm}
    assert collective.main(argv[:-1] + ["--algo", "ring", "--fabric", "efa-p5"]) == 0
    text = capsys.readouterr().out
    assert "algorithm ring" in text and "efa-p5" in text and "busbw" in text


@pytest.mark.parametrize("size, bytes_", [("32MiB", 32 * MiB), ("8G", 8 * GiB),
                                          ("1.5 GB", 1_500_000_000), ("4096", 4096)])
def test_sizes_take_suffixes(size, bytes_):
    assert collective.parse_size(size) == bytes_


@pytest.mark.parametrize("argv, message", [
    (["--size", "32XB"], "--size '32XB'"),
    (["--size", "1MiB", "--fabric", "myrinet"], "--fabric 'myrinet': unknown"),
    (["--size", "1MiB", "--nodes", "0"], "--nodes must be >= 1"),
    (["--size", "1MiB", "--op", "all-gather", "--algo", "tree", "--nodes", "2"],
     "NCCL has no tree for all-gather"),
    (["--size", "1MiB", "--hardware", "tpu-v5p", "--fabric", "ib-400"], "not a GPU"),
])
def test_bad_input_is_one_line_and_exit_2(capsys, argv, message):
    assert collective.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error: ") and message in err[-1]
