"""The chip catalog: the built-in figures against the datasheet numbers quoted beside them,
kind names and aliases, the bandwidth a mesh axis gets on a torus or a switch, machines of
several ICI domains, and catalog files (a ``base`` kind with overrides, and every way a
file or a ``--chips`` spec can be wrong)."""

import math
import os

import pytest

import jaxpar
from jaxpar.planner import BUILTIN, parse_chips, plan
from jaxpar.planner.catalog import cpu_chip, load_catalog, resolve_kind

GB, GiB = 1e9, 2**30
GBIT = 1e9 / 8  # one gigabit per second in bytes per second


def test_unknown_chip_lists_known_kinds():
    with pytest.raises(jaxpar.JaxparError, match="unknown chip kind 'tpu-v9'.*tpu-v5p"):
        parse_chips("tpu-v9:8")
    with pytest.raises(jaxpar.JaxparError, match="kind:count"):
        parse_chips("h100")
    assert parse_chips("h100:64").slices == 8  # 8 NVLink nodes of 8


def test_bad_override_and_custom_catalog(tmp_path):
    with pytest.raises(jaxpar.JaxparError, match="unknown config key"):
        plan("configs/tiny.yaml", chips="cpu:8", global_batch=8, seq=64,
             overrides=["model.n_layer=3"])
    catalog = tmp_path / "chips.yaml"
    catalog.write_text("my-chip:\n  base: tpu-v5e\n  hbm_bytes: 64.0e9\n")
    machine = parse_chips("my-chip:16", catalog=catalog)
    assert machine.chip.hbm_bytes == 64e9 and machine.chip.peak_flops == 197e12


# (kind, figures) as the datasheets quoted in jaxpar/planner/catalog.py state them.
DATASHEETS = {
    "tpu-v4": {"peak_flops": 275e12, "hbm_bytes": 32 * GiB, "hbm_bw": 1200 * GB,
               "dcn_bw": 25 * GBIT, "domain": 4096, "torus_dims": 3, "ici_links": 6,
               "matmul_tile": 128},
    # v5e and v6e HBM in GiB: the TPU compiler gives a program 15.75 and 31.25 GiB of it.
    "tpu-v5e": {"peak_flops": 197e12, "hbm_bytes": 16 * GiB, "hbm_bw": 819 * GB,
                "ici_bw": 1600 * GBIT, "dcn_bw": 25 * GBIT, "domain": 256, "torus_dims": 2,
                "ici_links": 4, "matmul_tile": 128},
    "tpu-v5p": {"peak_flops": 459e12, "hbm_bytes": 95 * GiB, "hbm_bw": 2765 * GB,
                "ici_bw": 4800 * GBIT, "dcn_bw": 50 * GBIT, "domain": 6144, "torus_dims": 3,
                "ici_links": 6, "matmul_tile": 128},
    "tpu-v6e": {"peak_flops": 918e12, "hbm_bytes": 32 * GiB, "hbm_bw": 1640 * GB,
                "ici_bw": 3584 * GBIT, "dcn_bw": 100 * GBIT, "domain": 256, "torus_dims": 2,
                "ici_links": 4, "matmul_tile": 256},
    "tpu-v7": {"peak_flops": 2307e12, "hbm_bw": 7380 * GB, "domain": 9216, "torus_dims": 3,
               "ici_links": 6, "ici_link_bw": 90 * GB},
    "a100-80gb": {"peak_flops": 312e12, "f32_flops": 19.5e12, "hbm_bytes": 80 * GB,
                  "hbm_bw": 2039 * GB, "ici_bw": 300 * GB, "dcn_bw": 200 * GBIT, "domain": 8,
                  "torus_dims": 0},
    "h100": {"peak_flops": 989e12, "f32_flops": 67e12, "hbm_bytes": 80 * GB,
             "hbm_bw": 3350 * GB, "ici_bw": 450 * GB, "dcn_bw": 400 * GBIT, "domain": 8,
             "torus_dims": 0},
    "h200": {"peak_flops": 989e12, "hbm_bytes": 141 * GB, "hbm_bw": 4800 * GB,
             "ici_bw": 450 * GB, "dcn_bw": 400 * GBIT, "domain": 8, "torus_dims": 0},
    "b200": {"peak_flops": 2250e12, "hbm_bytes": 180 * GB, "hbm_bw": 8000 * GB,
             "ici_bw": 900 * GB, "dcn_bw": 400 * GBIT, "domain": 8, "torus_dims": 0},
}


@pytest.mark.parametrize("kind", list(DATASHEETS))
def test_builtin_figures_match_the_datasheets(kind):
    chip = BUILTIN[kind]
    assert chip.name == kind and chip.source
    for field, value in DATASHEETS[kind].items():
        assert getattr(chip, field) == pytest.approx(value, rel=1e-9), field
    # Every efficiency is a fraction; accelerators overlap collectives with compute.
    for field in ("matmul_efficiency", "memory_efficiency", "collective_efficiency"):
        assert 0 < getattr(chip, field) <= 1, field
    assert chip.overlap == 1.0


def test_float32_rate_defaults_to_a_third_of_the_bf16_peak():
    # TPUs list no f32 figure: three bf16 passes on the MXU.
    assert BUILTIN["tpu-v5p"].f32_flops == 0
    assert BUILTIN["tpu-v5p"].matmul_flops_f32 == pytest.approx(459e12 / 3)
    assert BUILTIN["h100"].matmul_flops_f32 == 67e12


@pytest.mark.parametrize(("text", "key"), [
    ("tpu-v5p", "tpu-v5p"), ("V5P", "tpu-v5p"), (" trillium ", "tpu-v6e"),
    ("ironwood", "tpu-v7"), ("tpu7x", "tpu-v7"), ("a100", "a100-80gb"),
    ("H100-80GB", "h100"), ("cpu", "cpu")])
def test_kind_names_and_aliases(text, key):
    assert resolve_kind(text) == key


# (chip, chips in the slice, axis size, bytes/s one way). A v5p slice of 64 is a 4x4x4
# torus: an axis of up to 4 chips spans one dimension, up to 16 two, 64 all three, and
# each dimension gives two links of 90 GB/s (a bidirectional ring). A v5e pod of 256 is a
# 16x16 torus with 45 GB/s links. NVLink gives every axis the same 450 GB/s.
AXIS_BANDWIDTH = [
    ("tpu-v5p", 64, 2, 2 * 90 * GB), ("tpu-v5p", 64, 4, 2 * 90 * GB),
    ("tpu-v5p", 64, 8, 4 * 90 * GB), ("tpu-v5p", 64, 16, 4 * 90 * GB),
    ("tpu-v5p", 64, 64, 6 * 90 * GB), ("tpu-v5p", 4096, 16, 2 * 90 * GB),
    ("tpu-v5p", 4096, 256, 4 * 90 * GB), ("tpu-v5e", 256, 16, 2 * 45 * GB),
    ("tpu-v5e", 256, 256, 4 * 45 * GB), ("h100", 8, 2, 450 * GB), ("h100", 8, 8, 450 * GB),
]


@pytest.mark.parametrize(("kind", "per_slice", "n", "bandwidth"), AXIS_BANDWIDTH)
def test_axis_bandwidth_counts_the_torus_dimensions_an_axis_spans(kind, per_slice, n,
                                                                  bandwidth):
    assert BUILTIN[kind].axis_bandwidth(n, per_slice) == pytest.approx(bandwidth)


def test_an_axis_of_one_chip_has_unbounded_bandwidth():
    assert BUILTIN["tpu-v5p"].axis_bandwidth(1, 64) == math.inf
    assert BUILTIN["h100"].axis_bandwidth(1, 8) == math.inf


def test_machines_split_into_ici_domains():
    one = parse_chips("tpu-v5p:256")
    assert (one.count, one.slices, one.per_slice) == (256, 1, 256)
    assert one.describe() == "256 x tpu-v5p (1 slice)"
    nodes = parse_chips("h100:64")  # eight DGX nodes of eight GPUs
    assert (nodes.slices, nodes.per_slice) == (8, 8)
    assert nodes.describe() == "64 x h100 (8 slices)"
    assert parse_chips("tpu-v5e:512", slices=4).per_slice == 128


@pytest.mark.parametrize(("text", "slices", "message"), [
    ("tpu-v5p:0", 1, "kind:count"),
    ("tpu-v5p:", 1, "kind:count"),
    ("tpu-v5p:eight", 1, "kind:count"),
    ("tpu-v5p:10", 3, "10 tpu-v5p chips do not split into 3 slices"),
    ("h100:32", 2, r"16 chips per slice exceed one h100 ICI domain of 8; pass --slices 4"),
])
def test_bad_chip_specs_are_refused(text, slices, message):
    with pytest.raises(jaxpar.JaxparError, match=message):
        parse_chips(text, slices=slices)


def test_cpu_devices_share_the_host():
    cores = os.cpu_count() or 1
    chip = parse_chips("cpu:8").chip
    assert chip.name == "cpu" and chip.overlap == 0  # XLA:CPU's collectives block
    # cores x 2 GHz x 32 f32 FLOP a cycle, shared by the 8 simulated devices.
    assert chip.peak_flops == pytest.approx(cores * 2e9 * 32 / 8)
    assert cpu_chip(2).hbm_bw == pytest.approx(4 * cpu_chip(8).hbm_bw)


def test_catalog_file_adds_a_chip_of_its_own(tmp_path):
    path = tmp_path / "chips.yaml"
    path.write_text("lab-gpu:\n  peak_flops: 1.0e15\n  hbm_bytes: 96.0e9\n  ici_bw: 4.0e11\n"
                    "  dcn_bw: 5.0e10\n  domain: 4\n")
    chips = load_catalog(path)
    assert set(BUILTIN) < set(chips)  # the built-in kinds stay
    chip = chips["lab-gpu"]
    assert (chip.peak_flops, chip.hbm_bytes, chip.domain) == (1e15, 96e9, 4)
    assert isinstance(chip.domain, int) and chip.source == str(path)
    assert parse_chips("lab-gpu:8", catalog=path).slices == 2


@pytest.mark.parametrize(("text", "message"), [
    ("a: [1, 2\n", "is not YAML"),
    ("- tpu-v5p\n", "must map chip names to their figures"),
    ("lab: 3\n", "catalog entry 'lab' must be a mapping"),
    ("lab:\n  base: tpu-v5p\n  peak_flop: 1.0\n", "'lab' has unknown field 'peak_flop'"),
    ("lab:\n  peak_flops: 1.0e15\n  hbm_bytes: 1.0e9\n", r"'lab' lacks \['ici_bw', 'dcn_bw',"),
    ("lab:\n  base: tpu-v5p\n  hbm_bytes: lots\n", "'lab': hbm_bytes='lots' is not a number"),
    ("lab:\n  base: tpu-v9\n", "unknown chip kind 'tpu-v9'"),
    ("lab:\n  base: tpu-v5p\n  peak_flops: 0\n", r"'lab' in .*: peak_flops=0.0 must be positive"),
    ("lab:\n  base: tpu-v5p\n  domain: 0\n", "domain=0 must be positive"),
    ("lab:\n  base: tpu-v5p\n  hbm_bw: -3.0e12\n", "hbm_bw=-3000000000000.0 must be positive"),
    ("lab:\n  base: tpu-v5p\n  dcn_bw: -1.0e10\n", "dcn_bw=-10000000000.0 must be positive"),
    ("lab:\n  base: tpu-v5p\n  host_bw: .nan\n", "host_bw=nan must be a finite number"),
    ("lab:\n  base: tpu-v5p\n  ici_latency_s: -1\n", "ici_latency_s=-1.0 must not be negative"),
    ("lab:\n  base: tpu-v5p\n  overlap: 2\n", "overlap=2.0 must be between 0 and 1"),
    ("lab:\n  base: tpu-v5p\n  torus_dims: 4\n", "torus_dims=4 must be 0"),
    ("cpu2:\n  base: cpu\n", "base 'cpu' has no fixed figures"),
])
def test_bad_catalog_files_name_the_culprit(tmp_path, text, message):
    path = tmp_path / "chips.yaml"
    path.write_text(text)
    with pytest.raises(jaxpar.JaxparError, match=message):
        load_catalog(path)


def test_missing_catalog_file(tmp_path):
    with pytest.raises(jaxpar.JaxparError, match="nope.yaml' does not exist"):
        load_catalog(tmp_path / "nope.yaml")
    with pytest.raises(jaxpar.JaxparError, match="is a folder; give a YAML file"):
        load_catalog(tmp_path)


def test_builtin_chips_pass_the_catalog_checks():
    import dataclasses

    from jaxpar.planner.catalog import chip_from_mapping
    for name, chip in {**BUILTIN, "cpu": cpu_chip(8)}.items():
        fields = {k: v for k, v in dataclasses.asdict(chip).items() if k != "name"}
        assert chip_from_mapping(name, fields) == chip
