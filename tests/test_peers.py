"""benchmarks.peers and benchmarks/profile_breakdown.py on CPU; neither flax nor torch
is needed (their rows must then say "skipped"). No timing assertions."""
import gzip
import importlib.util
import json
import os
import pathlib
import statistics

import pytest

from benchmarks import profile_breakdown as pb
from benchmarks.peers import driver as peers
from vit_pure import PRESETS
from vit_pure.run import hostmem
from vit_pure.xla import hlo


# --------------------------------------------------------------------------------- peers
def test_table_rows_mfu_and_failures():
    ok = {"name": "kit", "batch": 100, "step_s": [2.0, 0.5, 1.0], "compile_s": 3.25,
          "peak_bytes": 3 * 2 ** 30, "params": 1234, "loss": 2.5}
    rows = [ok, {**ok, "name": "torch-eager", "peak_bytes": None},
            {"name": "nnx", "error": "error: ValueError: a|b"},
            {"name": "torch-compile", "skipped": "skipped: torch not installed"}]
    # median step 1 s -> 100 img/s; 1e9 FLOP/img -> 0.1 TFLOP/s = 10% of 1e12.
    lines = peers.markdown_table(rows, 1e9, 1e12).splitlines()
    assert lines[0].startswith("| entry | img/s | step ms | MFU |")
    cells = [c.strip() for c in lines[2].strip("|").split("|")]
    assert cells == ["kit", "100", "1000.0", "10.0%", "0.1", "3.00", "3.2", "1,234", "2.5000"]
    assert "| n/a |" in lines[3]  # no peak memory (CPU)
    assert lines[4].startswith("| nnx | failed: error: ValueError: a/b |")
    assert lines[5].startswith("| torch-compile | skipped: torch not installed |")
    assert all(line.count("|") == lines[0].count("|") for line in lines)
    assert "| n/a |" in peers.markdown_table([ok], 1e9, None)  # no ceiling: MFU n/a


def test_rounds_alternate_and_combine():
    assert [peers.round_order(3, k) for k in range(3)] == [[0, 1, 2], [2, 1, 0], [0, 1, 2]]
    row = {"name": "kit", "batch": 100, "compile_s": 3.0, "peak_bytes": None, "loss": 2.5,
           "params": 1}
    one = [{**row, "step_s": [1.0, 2.0, 4.0]}, {"name": "nnx", "skipped": "skipped: x"}]
    assert peers.combine_rounds([one]) == one  # one round: the rows as they are
    rounds = [one,
              [{**row, "step_s": [0.5, 0.5], "compile_s": 5.0, "loss": 9.0}, one[1]],
              [{**row, "step_s": [1.0], "compile_s": 4.0, "peak_bytes": 7}, one[1]]]
    kit, nnx = peers.combine_rounds(rounds)
    assert kit["step_s"] == [2.0, 0.5, 1.0]  # each round's median
    assert kit["round_img_s"] == [50.0, 200.0, 100.0]
    assert (kit["compile_s"], kit["peak_bytes"], kit["loss"]) == (4.0, 7, 2.5)
    assert nnx == one[1]
    # the table: the median over rounds (1 s -> 100 img/s)
    assert "| kit | 100 | 1000.0 |" in peers.markdown_table([kit], 1e9, None)
    failed = {"name": "kit", "error": "error: boom"}
    assert peers.combine_rounds([one, [failed, one[1]]])[0] == failed


def test_kit_variant_flags():
    assert peers.parse_kit_variant("as written=") == ("as written", {}, [])
    assert peers.parse_kit_variant("nodrop=--no-scan --dropout 0") == (
        "nodrop", {}, ["--no-scan", "--dropout", "0"])
    # Leading NAME=VALUE words are the row's environment, as in a shell.
    assert peers.parse_kit_variant(
        "lt=XLA_FLAGS='--xla_a=1 --xla_b=2' JAX_X=0 --dropout 0") == (
        "lt", {"XLA_FLAGS": "--xla_a=1 --xla_b=2", "JAX_X": "0"}, ["--dropout", "0"])
    assert peers.parse_kit_variant("env only=XLA_FLAGS=--xla_a=1") == (
        "env only", {"XLA_FLAGS": "--xla_a=1"}, [])
    for bad in ("no-equals-sign", "=--no-scan", "x=--remat 'block"):
        with pytest.raises(peers.UsageError):
            peers.parse_kit_variant(bad)
    with pytest.raises(peers.UsageError, match="refuses"):
        peers.check_kit_flags(["--no-such-flag"], "x=--no-such-flag")


# The kit row of the tests below: no dropout, no RandAugment (cheaper to compile).
NODROP = "--dropout 0 --randaugment 0"


def test_kit_row_and_skipped_peers(tmp_path):
    """The real kit step on the tiny model, 2 timed steps, in a child process; the peers
    whose package is missing are rows that say so (those installed: test below)."""
    missing = [e for e, pkg in peers.NEEDS.items() if importlib.util.find_spec(pkg) is None]
    out = tmp_path / "peers.json"
    record = peers.main(["--model", "tiny", "--batch", "8", "--steps", "2", "--warmup", "1",
                         "--only", ",".join(["kit", *missing]),
                         "--kit", f"nodrop=VIT_PURE_PEERS_PROBE=on {NODROP}",
                         "--matmul-size", "64", "--json", str(out),
                         "--programs", str(tmp_path / "programs")])
    assert json.loads(out.read_text()) == json.loads(json.dumps(record))
    assert record["ceiling"]["flops_per_s"] > 0
    kit, *rest = record["results"]
    assert kit["name"] == "kit: nodrop" and "error" not in kit, kit
    assert len(kit["step_s"]) == 2 and kit["params"] == 23_282  # the tiny preset
    assert "dropout=0.0" in kit["step_config"]
    # --programs: the row's step as XLA compiled it, a module the HLO reader takes.
    assert kit["program"] == str(tmp_path / "programs" / "kit-nodrop.hlo.txt.gz")
    program = hlo.parse_module(gzip.decompress(pathlib.Path(kit["program"]).read_bytes()).decode())
    assert program.name and hlo.dot_flops(program) > 0
    assert kit["loss"] == pytest.approx(kit["loss"]) and 0 < kit["loss"] < 10
    # The kit's row runs with the malloc setting of its training scripts; the ceiling
    # (and the peers) in the environment as given.
    assert kit["glibc_tunables"] == hostmem.environ().get("GLIBC_TUNABLES", "")
    assert record["ceiling"]["glibc_tunables"] == os.environ.get("GLIBC_TUNABLES", "")
    if hostmem.wanted():
        assert hostmem.TUNABLE in kit["glibc_tunables"]
        assert hostmem.TUNABLE not in record["ceiling"]["glibc_tunables"]
    # The row's NAME=VALUE words reach its process (and only its process).
    assert kit["env"] == {"VIT_PURE_PEERS_PROBE": "on"}
    assert "VIT_PURE_PEERS_PROBE" not in os.environ
    for row, entry in zip(rest, missing):
        assert row == {"name": entry, "skipped": f"skipped: {peers.NEEDS[entry]} not installed"}


@pytest.mark.slow
@pytest.mark.parametrize("entry", ["nnx", "torch-eager", "torch-compile"])
def test_installed_peer_runs(entry):
    pytest.importorskip(peers.NEEDS[entry])
    record = peers.main(["--model", "tiny", "--batch", "8", "--steps", "2", "--warmup", "1",
                         "--only", entry, "--matmul-size", "64", "--entry-timeout", "600"])
    (row,) = record["results"]
    assert "error" not in row, row
    assert row["params"] == 23_282 and 0 < row["loss"] < 10  # the same model as the kit


@pytest.mark.slow
def test_rounds_run_each_row_again_in_reverse(tmp_path, capsys):
    out = tmp_path / "peers.json"
    # Both rows run the program of test_kit_row_and_skipped_peers's row (no dropout, no
    # RandAugment: RandAugment alone doubles the tiny step's compile time), which the run's
    # compilation cache holds once any of them has compiled it: the rounds' bookkeeping is
    # under test here, not what the rows run.
    record = peers.main(["--model", "tiny", "--batch", "8", "--steps", "2", "--warmup", "1",
                         "--only", "kit", "--kit", f"a={NODROP}", "--kit", f"b={NODROP}",
                         "--rounds", "2", "--matmul-size", "64", "--json", str(out)])
    printed = capsys.readouterr().out
    assert "# round 1/2: kit: a, kit: b" in printed and "# round 2/2: kit: b, kit: a" in printed
    assert json.loads(out.read_text()) == json.loads(json.dumps(record))
    assert [[r["name"] for r in rows] for rows in record["rounds"]] == [["kit: a", "kit: b"]] * 2
    for i, row in enumerate(record["results"]):
        runs = [rows[i] for rows in record["rounds"]]
        assert row["step_s"] == [statistics.median(r["step_s"]) for r in runs]
        assert len(row["round_img_s"]) == 2
        assert f"  {row['name']}: " in printed


@pytest.mark.slow
def test_profile_kit(tmp_path, capsys):
    # The row of test_kit_row_and_skipped_peers's program (its compile cached), whose
    # matmuls the profile's categories must show as any step's would.
    record = peers.main(["--model", "tiny", "--batch", "8", "--steps", "1", "--warmup", "1",
                         "--only", "kit", "--kit", f"nodrop={NODROP}", "--matmul-size", "64",
                         "--profile-kit", str(tmp_path)])
    assert record["profile"]["total_us"] > 0
    assert "gemm/matmul" in {c["category"] for c in record["profile"]["categories"]}
    assert "| category | ms | % |" in capsys.readouterr().out


# ----------------------------------------------------------------------- profile_breakdown
@pytest.mark.parametrize("name, category", [
    ("nvjet_sm90_tst_128x160_64x5_2x1_v_bz_TNT", "gemm/matmul"),
    ("gemm_fusion_dot_138", "gemm/matmul"),
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64", "gemm/matmul"),
    ("cutlass_80_tensorop_bf16_s16816gemm_relu_bf16_64x64_64x4_nn_align8", "gemm/matmul"),
    ("ynn_fusion.28", "gemm/matmul"),
    ("dot_general.72", "gemm/matmul"),
    ("cudnn_generated_fort_native_sdpa_sm90_flash_fprop", "attention"),
    ("MemcpyD2D", "memcpy"),
    ("Memset", "memcpy"),
    ("loop_dynamic_update_slice_fusion_3", "dynamic-update-slice"),
    ("input_reduce_fusion_164", "reduction"),
    ("triton_red_fused_native_layer_norm_0", "reduction"),
    ("input_transpose_fusion_2", "transpose/copy"),
    ("copy.1020", "transpose/copy"),
    ("loop_convert_fusion", "convert"),
    ("shift-right-logical_convert_fusion", "random"),
    ("loop_add_xor_fusion", "random"),
    ("threefry2x32", "random"),
    ("loop_add_fusion", "fusion"),
    ("triton_poi_fused_add_0", "fusion"),
    ("ncclDevKernel_AllReduce_Sum_f32_RING_LL", "collective"),
    ("while.1403", "other"),
])
def test_classify(name, category):
    assert pb.classify(name) == category


def test_classify_falls_back_to_hlo_op():
    assert pb.classify("some_vendor_kernel") == "other"
    assert pb.classify("some_vendor_kernel", "custom-call.3") == "other"
    assert pb.classify("some_vendor_kernel", "dot.7") == "gemm/matmul"


def _meta(pid, tid=None, name=""):
    kind = "process_name" if tid is None else "thread_name"
    return {"ph": "M", "pid": pid, **({} if tid is None else {"tid": tid}), "name": kind,
            "args": {"name": name}}


def _x(pid, tid, name, ts, dur, **args):
    return {"ph": "X", "pid": pid, "tid": tid, "name": name, "ts": ts, "dur": dur,
            "args": args}


def _write(path, events):
    path.parent.mkdir(parents=True, exist_ok=True)
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": events}, f)


def test_gpu_trace_counts_stream_kernels_once(tmp_path, capsys):
    events = [_meta(1, name="/device:GPU:0"), _meta(1, 7, "Stream #7(Compute,MemcpyD2D)"),
              _meta(1, 8, "XLA Ops"), _meta(2, name="/host:CPU"), _meta(2, 9, "python"),
              # overlapping kernels on one stream (programmatic dependent launch): both count
              _x(1, 7, "nvjet_sm90_tst_128x160", 0, 60), _x(1, 7, "input_reduce_fusion", 50, 30),
              _x(1, 7, "MemcpyD2D", 100, 10),
              _x(1, 8, "fusion.1", 0, 200),       # derived line: restates the kernels
              _x(2, 9, "jit_train_step", 0, 500)]  # host: not device time
    _write(tmp_path / "plugins/profile/run1/host.trace.json.gz", events)
    result, source, files = pb.analyse(str(tmp_path))
    assert "1 GPU device" in source and files[0].endswith("run1/host.trace.json.gz")
    assert result["total_us"] == 100 and result["events"] == 3
    assert {c["category"]: c["percent"] for c in result["categories"]} == {
        "memcpy": 10.0, "gemm/matmul": 60.0, "reduction": 30.0}
    assert [k["name"] for k in result["top"]][0] == "nvjet_sm90_tst_128x160"
    assert pb.main([str(tmp_path), "--top", "2"]) == 0
    assert "| nvjet_sm90_tst_128x160 | gemm/matmul | 1 | 0.06 | 60.0 |" in capsys.readouterr().out


def test_cpu_trace_counts_self_time_of_nested_ops(tmp_path):
    op = {"hlo_op": "x", "hlo_module": "jit_train_step"}
    events = [_meta(5, name="/host:CPU"), _meta(5, 1, "tf_XLAEigen"),
              _x(5, 1, "while.3", 0, 100, **op),         # encloses the two body ops
              _x(5, 1, "dot.1", 10, 50, **op), _x(5, 1, "add_fusion", 70, 20, **op),
              _x(5, 1, "ThunkExecutor::Execute", 0, 300),  # no hlo_op: not an XLA op
              _x(5, 2, "copy.2", 0, 40, **op)]
    path = tmp_path / "t.trace.json.gz"
    _write(path, events)
    result, source, _ = pb.analyse(str(path))
    assert source.startswith(pb.CPU_SOURCE)
    assert result["total_us"] == 140  # while's self time 30 + 50 + 20 + 40
    cats = {c["category"]: c["us"] for c in result["categories"]}
    assert cats == {"gemm/matmul": 50, "transpose/copy": 40, "fusion": 20, "other": 30}


def test_breakdown_bad_paths(tmp_path, capsys):
    assert pb.main([str(tmp_path / "missing")]) == 2
    assert pb.main([str(tmp_path)]) == 2  # a directory without traces
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and all(line.startswith("error: ") for line in err)


def test_gemm_epilogues_counts_gemms_by_library_and_epilogue():
    """benchmarks/probes/gemm_epilogues.py reads XLA:GPU's optimized HLO: lines written the way
    XLA prints its GEMM custom calls and fusions."""
    from benchmarks.probes import gemm_epilogues as ge
    gpu = "\n".join([
        '  %cublas-lt-matmul.3 = (bf16[266240,1536]{1,0}, s8[4194304]{0}) custom-call('
        'bf16[266240,384]{1,0} %a, bf16[384,1536]{1,0} %b, bf16[1536]{0} %c), '
        'custom_call_target="__cublas$lt$matmul", backend_config={"operation_queue_id":"0",'
        '"gemm_backend_config":{"alpha_real":1,"beta":0,"epilogue":"BIAS_GELU_AUX"}}',
        '  %cublas-gemm.1 = (bf16[8,8]{1,0}, s8[0]{0}) custom-call(bf16[8,4]{1,0} %a, '
        'bf16[4,8]{1,0} %b), custom_call_target="__cublas$gemm", backend_config={'
        '"gemm_backend_config":{"epilogue":"DEFAULT"}}',
        '  %gemm_fusion_dot.2 = bf16[8,8]{1,0} fusion(bf16[8,4]{1,0} %a, bf16[4,8]{1,0} %b), '
        'kind=kCustom, calls=%gemm_fusion_dot.2_computation, backend_config={'
        '"fusion_backend_config":{"kind":"__triton_gemm"}}',
        '  %dot.1 = bf16[8,8]{1,0} dot(bf16[8,4]{1,0} %p0, bf16[4,8]{1,0} %p1), '
        'lhs_contracting_dims={1}, rhs_contracting_dims={0}',
        '  %custom-call.9 = f32[4]{0} custom-call(f32[4]{0} %x), custom_call_target="Sharding"'])
    assert ge.count_gemms(gpu) == {("__cublas$lt$matmul", "BIAS_GELU_AUX"): 1,
                                   ("__cublas$gemm", "DEFAULT"): 1, ("__triton_gemm", "-"): 1}
    assert "| __cublas$lt$matmul | BIAS_GELU_AUX | 1 |" in ge.format_table(ge.count_gemms(gpu))


@pytest.mark.slow
def test_gemm_epilogues_on_the_cpu_step():
    """The tiny model's real compiled step on a CPU, one dot per product: per block 6
    forward products (qkv, scores, context, output, fc1, fc2) and 2 backward each; in the
    last, on the class token, 8 forward (k, v and q each its own) and 2 backward each but
    for the keys' and values' gradients of the one-query products, outer products XLA
    computes as multiplies; the patch embedding's forward and weight gradient; the head's
    forward and 2 backward."""
    from benchmarks.probes import gemm_epilogues as ge
    counts = ge.main(["--model", "tiny", "--batch", "8"])
    last_block = 8 + 2 * 8 - 2
    assert counts == {("dot", "-"): 6 * 3 * (PRESETS["tiny"].depth - 1) + last_block + 2 + 3}
