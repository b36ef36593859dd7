"""XLA's memory-usage report (jaxpar.analysis.buffers): read from its text, and asked
for through XLA's flags."""

import os

from jaxpar.analysis.buffers import enable_dump, peak_buffers, read_report

# The head of a report as the TPU compiler writes it (22B on tpu-v4:4x4x4), cut short;
# a second memory space follows the first.
REPORT = """\
Memory Space: default (color=0)
Total bytes: 24356046848 (22.68GiB)
  cumulative_size;       size;       offset; used_by_n_values; shapes_list
  ------------------------------------------------------------
    9.00GiB( 32%);    9.00GiB;   1207959552;                5; 5×bf16[48,16,1024,6144]
   10.50GiB( 37%);    1.50GiB;  12129927168;                1; f32[16,24,1024,1024]
   17.50GiB( 62%);  768.00MiB;            0;                4; f32[], s32[16,1024], 2×f32[32768,6144]
  The rest 217 values are less than 5% of the total size and not shown.

  cumulative_size;       size;       offset; used_by_n_values; shapes_list
  ------------------------------------------------------------
  288.00MiB(100%);  288.00MiB;            0;                2; 2×f32[48,96,16384]

Memory Space: smem (color=2)
Total bytes: 48 (48B)
"""  # noqa: E501


def test_the_first_memory_spaces_slots_are_read_largest_first():
    total, slots = read_report(REPORT)
    assert total == 24356046848
    assert [(s.bytes, s.values) for s in slots] == [(9 << 30, 5), (1536 << 20, 1),
                                                     (768 << 20, 4)]
    assert slots[2].shapes == "f32[], s32[16,1024], 2×f32[32768,6144]"


def test_the_step_modules_report_is_found_in_the_dump(tmp_path, monkeypatch):
    (tmp_path / "module_0001.jit__step_impl.cl_1.after_optimizations-memory-usage-report.txt"
     ).write_text(REPORT)
    (tmp_path / "module_0000.jit_other.after_optimizations-memory-usage-report.txt"
     ).write_text(REPORT.replace("24356046848", "99"))
    assert peak_buffers(tmp_path)[0] == 24356046848
    assert peak_buffers(tmp_path, module="nothing_like_it") is None
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    enable_dump(tmp_path)
    assert os.environ["XLA_FLAGS"] == (
        f"--xla_force_host_platform_device_count=8 --xla_dump_to={tmp_path} "
        "--xla_dump_hlo_module_re=.*_step_impl.*")
