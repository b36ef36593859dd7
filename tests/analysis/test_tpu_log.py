"""Reading the TPU compiler's account of a program's HBM from libtpu's log
(jaxpar.analysis.tpu_log); the account of a real compile is checked in
tests/analysis/test_targets.py."""

from jaxpar.analysis import tpu_log

# What libtpu logs for each program it compiles (abridged: two programs, the step last).
LOG = """\
I1201 backend.cc:2125] XLA::TPU module name: jit__step_impl
I1201 backend.cc:2127] XLA::TPU program HBM usage: 1.00G / 30.75G
I1201 backend.cc:2171] Total hbm usage >= 2.30G:
    reserved          1.25G
    program           1.00G
    arguments        50.00M
Program hbm requirement 1.00G:
{HEAP_1}
I1201 backend.cc:2125] XLA::TPU module name: jit_convert_element_type
I1201 backend.cc:2127] XLA::TPU program HBM usage: 1.0M / 30.75G
I1201 backend.cc:2125] XLA::TPU module name: jit__step_impl
I1201 backend.cc:2127] XLA::TPU program HBM usage: 7.36G / 30.75G
I1201 backend.cc:2144] XLA::TPU program Cmem usage: 124.85M / 128.00M
I1201 backend.cc:2171] Total hbm usage >= 8.80G:
    reserved          1.25G
    program           7.36G
    arguments       198.42M

Output size 198.35M; shares 198.35M with arguments.
I1201 backend.cc:2175] Program sflag requirement 448B:
    reserved           204B
    HLO temp 132B (100.0% utilization: Unpadded (132B) Padded (132B), 0.0% fragmentation (0B))
Program hbm requirement 7.36G:
    global           225.0K
    scoped            7.50M
{HEAP_2}
    overlays         52.83M
Program cmem requirement 124.85M:
    HLO temp 124.85M (0.0% utilization: Unpadded (0B) Padded (0B), 100.0% fragmentation (124.85M))
""".format(
    HEAP_1="    HLO temp 980.00M (99.0% utilization: Unpadded (900.00M) Padded (900.00M), "
           "8.2% fragmentation (80.00M))",
    HEAP_2="    HLO temp 7.30G (100.0% utilization: Unpadded (6.44G) Padded (6.44G), "
           "11.8% fragmentation (879.71M))")

G, M = 1 << 30, 1 << 20


def test_the_last_account_of_the_step_is_read_in_its_units():
    got = tpu_log.read_program_memory(LOG, "_step_impl")
    assert got == tpu_log.ProgramMemory(
        program_bytes=int(7.36 * G), heap_bytes=int(7.30 * G),
        fragmentation_bytes=int(879.71 * M), reserved_bytes=int(1.25 * G),
        usable_bytes=int(30.75 * G))


def test_a_log_without_the_module_or_its_account_gives_none():
    assert tpu_log.read_program_memory(LOG, "jit_train_step") is None
    truncated = LOG[:LOG.index("Program hbm requirement 7.36G")]
    assert tpu_log.read_program_memory(truncated, "_step_impl") is None


def test_the_log_is_found_by_process_and_the_flag_added_once(tmp_path):
    (tmp_path / "tpu_driver.host.user.log.INFO.20261201-131234.42").write_text(LOG)
    (tmp_path / "tpu_driver.host.user.log.INFO.20261201-131234.43").write_text("")
    got = tpu_log.program_memory("_step_impl", pid=42, log_dir=tmp_path)
    assert got is not None and got.program_bytes == int(7.36 * G)
    assert tpu_log.program_memory("_step_impl", pid=44, log_dir=tmp_path) is None
    # Only what the log gained after a mark: an earlier program never stands in.
    mark = tpu_log.log_mark(pid=42, log_dir=tmp_path)
    assert mark[1] == len(LOG.encode())
    assert tpu_log.program_memory("_step_impl", pid=42, log_dir=tmp_path, since=mark) is None
    env = {"LIBTPU_INIT_ARGS": "--xla_tpu_enable_async_all_gather=true"}
    tpu_log.unbuffer_compiler_log(env)
    tpu_log.unbuffer_compiler_log(env)
    assert env["LIBTPU_INIT_ARGS"].split() == ["--xla_tpu_enable_async_all_gather=true",
                                               tpu_log.LOG_FLAG]
