"""Plain-text tables of jaxpar.analysis.report: number formats, the aligned table, and the
whole ``jaxpar inspect`` report rendered from a hand-made report, against expected text."""

from jaxpar.analysis.report import (
    fit_line,
    fmt_axes,
    fmt_bytes,
    fmt_count,
    fmt_ratio,
    fmt_spec,
    render_inspection,
    table,
)


def test_table_and_bytes_formatting():
    assert fmt_bytes(512) == "512 B" and fmt_bytes(1536) == "1.50 KiB"
    assert fmt_bytes(None) == "-"
    text = table(["a", "bb"], [("x", 1), ("yyy", 22)], right=(1,))
    assert text.splitlines() == ["  a    bb", "  ---  --", "  x     1", "  yyy  22"]


def test_fmt_bytes_steps_through_binary_units():
    assert fmt_bytes(0) == "0 B"
    assert fmt_bytes(1023) == "1023 B"
    assert fmt_bytes(1024) == "1.00 KiB"
    assert fmt_bytes(5 * 2**20 + 2**19) == "5.50 MiB"
    assert fmt_bytes(3 * 2**30) == "3.00 GiB"
    assert fmt_bytes(2**40) == "1.00 TiB"
    assert fmt_bytes(2**60) == "1024.00 PiB"  # PiB is the largest unit
    assert fmt_bytes(-2048) == "-2.00 KiB"
    assert fmt_bytes(1536.0) == "1.50 KiB"


def test_fmt_count_ratio_spec_and_axes():
    assert fmt_count(None) == "-"
    assert fmt_count(12.4) == "12"
    assert fmt_count(999_999) == "999,999"
    assert fmt_count(1_000_000) == "1.000e+06"
    assert fmt_count(9.87e8) == "9.870e+08"
    assert fmt_ratio(3, 2) == "1.50"
    assert fmt_ratio(0, 5) == "0.00"
    assert fmt_ratio(None, 2) == fmt_ratio(1, None) == fmt_ratio(1, 0) == "-"
    assert fmt_spec([]) == "replicated"
    assert fmt_spec([None, "fsdp", ["data", "tensor"]]) == "(-, fsdp, {data,tensor})"
    assert fmt_spec([None]) == "(-)"
    assert fmt_axes(None) == "-" and fmt_axes([]) == "-"
    assert fmt_axes(["layers", None, "mlp"]) == "layers, -, mlp"


def test_table_without_rows_and_without_indent():
    assert table(["name", "n"], []) == "  name  n\n  ----  -"
    # Cells are padded to the widest in their column; trailing blanks are dropped.
    assert table(["k", "v"], [("long key", 1), ("k2", "")], indent=0).splitlines() == [
        "k         v", "--------  -", "long key  1", "k2"]


def _report() -> dict:
    return {
        "header": {"config": "configs/tiny.yaml", "n_devices": 8, "platform": "cpu",
                   "mesh": "data=2 x fsdp=4 (8 devices)", "plan": "rules fsdp_tp",
                   "global_batch": 16, "seq_len": 32, "compile_s": 1.26, "pipeline": ""},
        "param_count": 1_234_567,
        "params": [
            {"path": "embed", "shape": [256, 64], "dtype": "float32",
             "logical_axes": ["vocab", "embed"], "spec": [None, "fsdp"],
             "bytes_per_device": 16384, "trainable": True},
            {"path": "blocks/norm/scale", "shape": [2, 64], "dtype": "float32",
             "logical_axes": ["layers", None], "spec": [], "bytes_per_device": 512,
             "trainable": False},
        ],
        "replication": {"replicated_share": 0.0303,
                        "largest": [["blocks/norm/scale", [2, 64]]]},
        "memory": {"argument_bytes": 2048, "output_bytes": 1024, "temp_bytes": 3 * 2**20,
                   "alias_bytes": 1024, "total_bytes": 2048 + 3 * 2**20},
        "predicted": {"memory": {"argument_bytes": 3072}, "step_time_s": 0.0125},
        "comparison": {
            "collectives": [
                # 4 gathers in a loop of 4 trips: 16 runs of 1 KiB a step
                {"kind": "all-gather", "axes": ["fsdp"], "count": 4, "predicted_count": 4,
                 "bytes_per_device": 4096, "predicted_bytes_per_device": 2048,
                 "executions": 16, "wire_bytes_per_step": 16384, "predicted_executions": 8,
                 "predicted_wire_bytes_per_step": 8192, "in_collective_matmuls": 2},
                {"kind": "all-reduce", "axes": ["data"], "count": 1, "executions": 1,
                 "bytes_per_device": 1536, "wire_bytes_per_step": 1536},
            ],
            "predicted_flops": 2.5e9},
        "flops": 2e9,
        "flops_detail": {"xla_cost_analysis": 5e8},
        "notes": ["the planner knows no peak for cpu"],
    }


def test_render_inspection_matches_the_expected_text():
    expected = [
        "jaxpar inspect: configs/tiny.yaml on 8 cpu devices, mesh data=2 x fsdp=4 (8 devices)",
        "  model 1,234,567 params; rules fsdp_tp",
        "  batch 16 x 32 tokens, attention auto; one train step compiled in 1.3 s (not run)",
        "",
        # 16384 + 512 bytes = 16.5 KiB
        "Parameters: 2 arrays, 1,234,567 values, 16.50 KiB per device",
        "  replicated by the rules: 3.0% of parameter bytes (largest: blocks/norm/scale)",
        "  path               shape      dtype    logical axes  spec        per device",
        "  -----------------  ---------  -------  ------------  ----------  ----------  ------",
        "  embed              (256, 64)  float32  vocab, embed  (-, fsdp)    16.00 KiB",
        "  blocks/norm/scale  (2, 64)    float32  layers, -     replicated       512 B  frozen",
        "",
        "Memory per device (XLA)",
        "                                        measured  predicted  pred/meas",
        "  ------------------------------------  --------  ---------  ---------",
        "  arguments                             2.00 KiB   3.00 KiB       1.50",
        "  outputs                               1.00 KiB          -          -",
        "  temp                                  3.00 MiB          -          -",
        "  aliased (donated)                     1.00 KiB          -          -",
        "  total = args + outs - aliased + temp  3.00 MiB          -          -",
        "",
        "Collectives per device and step (each HLO instruction times its loops' trips; "
        "bytes a device receives)",
        "  kind        mesh axes  in HLO  runs  predicted   received  predicted  pred/meas",
        "  ----------  ---------  ------  ----  ---------  ---------  ---------  ---------",
        "  all-gather  fsdp            4    16          8  16.00 KiB   8.00 KiB       0.50",
        "  all-reduce  data            1     1          -   1.50 KiB          -          -",
        # 8192 predicted of 16384 + 1536 = 17920 measured bytes: 0.46
        "  total                       5    17             17.50 KiB   8.00 KiB       0.46",
        "  2 collective-permutes of the compiler's collective matmuls are counted under the "
        "gather or reduce-scatter they make up",
        "",
        "Compute per device",
        "                                               measured  predicted  pred/meas",
        "  ------------------------------------------  ---------  ---------  ---------",
        "  matmul FLOPs (every loop trip)              2.000e+09  2.500e+09       1.25",
        "  XLA cost analysis FLOPs (loop bodies once)  5.000e+08          -          -",
        "  step time (s), not run                              -     0.0125          -",
        "",
        "note: the planner knows no peak for cpu",
    ]
    assert render_inspection(_report()).split("\n") == expected


def test_render_inspection_of_a_single_device_without_a_prediction():
    report = _report()
    report["header"]["pipeline"] = "pipeline: 2 stages x 4 microbatches"
    report["params"] = report["params"][:1]
    del report["replication"]
    report["memory"] = {"argument_bytes": 100}
    report["predicted"] = None
    report["comparison"] = {"collectives": []}
    report["flops_detail"] = {}
    report["notes"] = []
    report["flops"] = 123.0
    lines = render_inspection(report).split("\n")
    assert lines[3] == "  pipeline: 2 stages x 4 microbatches"
    assert lines[5] == "Parameters: 1 arrays, 1,234,567 values, 16.00 KiB per device"
    assert lines[6].startswith("  path ")  # no replication line before the table
    memory = lines.index("Memory per device (XLA)")
    assert lines[memory + 3] == "  arguments     100 B          -          -"
    assert lines[memory + 4] == ""
    collectives = lines.index(
        "Collectives per device and step (each HLO instruction times its loops' trips; "
        "bytes a device receives)")
    assert lines[collectives + 1] == "  none (a single device, or nothing to communicate)"
    # The report ends with the compute table (no notes).
    assert lines[-3:] == [
        "                                  measured  predicted  pred/meas",
        "  ------------------------------  --------  ---------  ---------",
        "  matmul FLOPs (every loop trip)       123          -          -",
    ]


def test_the_fit_line_says_tight_above_95_percent():
    gib = 2**30
    assert fit_line({"total_bytes": 16 * gib, "hbm_bytes": 32 * gib}) == (
        "fits: 16.00 GiB of 32.00 GiB per device (50%)")
    assert fit_line({"total_bytes": 31.7 * gib, "hbm_bytes": 32 * gib}).startswith(
        "fits, tight: 31.70 GiB of 32.00 GiB per device (99%, above 95%")
    assert fit_line({"total_bytes": 33 * gib, "hbm_bytes": 32 * gib, "argument_bytes": gib,
                     "output_bytes": 0, "alias_bytes": 0, "temp_bytes": 32 * gib}
                    ).startswith("does not fit: 33.00 GiB needed")
