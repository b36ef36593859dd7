"""Multi-process plumbing (jaxpar.runs.distributed): joining a run (initialize) from
arguments and the environment, simulated devices, a free port, and running processes
together (run_all): merged output, the process blamed for a failure, the others stopped.
``jax.distributed.initialize`` and ``jax.config.update`` are replaced where a test would
otherwise change this process's JAX."""

import io
import os
import signal
import socket
import sys
import time

import jax
import pytest

from jaxpar.errors import JaxparError
from jaxpar.runs.distributed import (
    first_failure,
    free_port,
    initialize,
    run_all,
    simulate_devices,
)

ENV = ("JAXPAR_COORDINATOR", "JAXPAR_NUM_PROCESSES", "JAXPAR_PROCESS_ID",
       "JAXPAR_DISTRIBUTED", "TPU_WORKER_HOSTNAMES")


def test_a_failing_process_stops_the_others():
    out = io.StringIO()
    start = time.monotonic()
    code = run_all([[sys.executable, "-c", "print('bye'); raise SystemExit(3)"],
                    [sys.executable, "-c", "import time; print('hi', flush=True); "
                     "time.sleep(60)"]], out=out, grace_s=2)
    assert code == 3 and time.monotonic() - start < 20
    assert "[0] bye" in out.getvalue()


def test_first_failure_is_the_earliest_failed_exit():
    # (exit time, exit code) per process: 0 failed last (a collective that lost its peer).
    assert first_failure({0: (9.0, 1), 1: (2.0, 2), 2: (1.0, 0)}) == 1
    assert first_failure({0: (3.0, 1), 1: (3.0, 2)}) == 0  # a tie: the lower index
    assert first_failure({0: (1.0, 0), 1: (2.0, 0)}) is None
    # 1 printed its jaxpar: error: line at 0.5 and took until 4.0 to exit.
    assert first_failure({0: (3.0, 1), 1: (4.0, 2)}, {1: 0.5}) == 1
    assert first_failure({0: (3.0, 0), 1: (4.0, 0)}, {1: 0.5}) is None
    assert first_failure({}) is None


@pytest.fixture
def jax_calls(monkeypatch):
    """A clean environment, and the calls initialize/simulate_devices make to JAX, as
    (name, args, kwargs), instead of making them."""
    for name in (*ENV, "JAX_PLATFORMS"):
        monkeypatch.delenv(name, raising=False)
    calls = []
    monkeypatch.setattr(jax.distributed, "initialize",
                        lambda *a, **k: calls.append(("initialize", a, k)))
    monkeypatch.setattr(jax.config, "update", lambda *a: calls.append(("update", a, {})))
    return calls


def test_a_single_process_run_joins_nothing(jax_calls, monkeypatch):
    assert initialize() is False
    monkeypatch.setenv("TPU_WORKER_HOSTNAMES", "host-0")  # a single TPU host
    assert initialize() is False
    monkeypatch.setenv("TPU_WORKER_HOSTNAMES", " host-0 , ,")
    assert initialize() is False
    monkeypatch.setenv("JAXPAR_PROCESS_ID", "")  # set but empty: not given
    assert initialize() is False
    assert jax_calls == []


def test_auto_detection_on_a_pod_or_on_request(jax_calls, monkeypatch):
    monkeypatch.setenv("TPU_WORKER_HOSTNAMES", "host-0,host-1")
    assert initialize() is True
    monkeypatch.delenv("TPU_WORKER_HOSTNAMES")
    monkeypatch.setenv("JAXPAR_DISTRIBUTED", "AUTO")
    assert initialize() is True
    assert jax_calls == [("initialize", (), {})] * 2  # JAX finds its peers itself


def test_the_three_given_as_arguments_or_environment(jax_calls, monkeypatch):
    gloo = ("update", ("jax_cpu_collectives_implementation", "gloo"), {})

    def joined(coordinator, num, pid):
        return [gloo, ("initialize", (), {"coordinator_address": coordinator,
                                         "num_processes": num, "process_id": pid})]

    assert initialize("10.0.0.1:1234", 2, 1) is True
    assert jax_calls == joined("10.0.0.1:1234", 2, 1)
    jax_calls.clear()
    monkeypatch.setenv("JAXPAR_COORDINATOR", "10.0.0.2:99")
    monkeypatch.setenv("JAXPAR_NUM_PROCESSES", " 4 ")
    monkeypatch.setenv("JAXPAR_PROCESS_ID", "3")
    assert initialize() is True
    assert jax_calls == joined("10.0.0.2:99", 4, 3)
    jax_calls.clear()
    # Arguments win over the environment, a process id of 0 included.
    assert initialize(num_processes=2, process_id=0) is True
    assert jax_calls == joined("10.0.0.2:99", 2, 0)


@pytest.mark.parametrize("args, env, message", [
    (("h:1", None, None), {}, r"missing --num-processes, --process-id$"),
    ((None, None, 0), {}, r"missing --coordinator, --num-processes$"),
    ((None, 2, None), {"JAXPAR_PROCESS_ID": "1"}, r"missing --coordinator$"),
    (("h:1", 2, -1), {}, r"^--process-id -1 is not in \[0, 2\) \(--num-processes 2\)$"),
    (("h:1", 0, 0), {}, r"^--process-id 0 is not in \[0, 0\)"),
    ((None, None, None), {"JAXPAR_COORDINATOR": "h:1", "JAXPAR_NUM_PROCESSES": "2",
                          "JAXPAR_PROCESS_ID": "1.0"},
     r"^environment variable JAXPAR_PROCESS_ID='1.0' is not an integer$"),
])
def test_a_partial_or_wrong_set_is_refused(args, env, message, jax_calls, monkeypatch):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(JaxparError, match=message):
        initialize(*args)
    assert jax_calls == []


def test_simulate_devices(jax_calls, monkeypatch):
    simulate_devices(None)
    assert jax_calls == [] and "JAX_PLATFORMS" not in os.environ
    simulate_devices(4)
    assert jax_calls == [("update", ("jax_platforms", "cpu"), {}),
                         ("update", ("jax_num_cpu_devices", 4), {})]
    assert os.environ["JAX_PLATFORMS"] == "cpu"
    monkeypatch.setenv("JAX_PLATFORMS", "cpu,cuda")
    simulate_devices(2)
    assert os.environ["JAX_PLATFORMS"] == "cpu,cuda"  # a setting of the user's is kept


def test_free_port_can_be_listened_on():
    port = free_port()
    assert isinstance(port, int) and 0 < port < 65536
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", port))
        s.listen()


PY = sys.executable


def test_run_all_merges_output_and_blames_the_process_that_failed(capsys, tmp_path):
    out = io.StringIO()
    # b fails once a has printed and ended (a marker file says so): stopping the others at
    # the first failure would otherwise race a's start on a loaded machine.
    done = tmp_path / "a-done"
    code = run_all([[PY, "-c", f"print('fine', flush=True); open({str(done)!r}, 'w').close()"],
                    [PY, "-c", f"import os, time\nwhile not os.path.exists({str(done)!r}): "
                               "time.sleep(0.01)\nraise ValueError('boom')"]],
                   prefixes=["a| ", "b| "], out=out)
    assert code == 1
    lines = out.getvalue().splitlines()
    assert "a| fine" in lines and "b| Traceback (most recent call last):" in lines
    assert "b| ValueError: boom" in lines
    assert capsys.readouterr().err == ("jaxpar launch: process 1 failed first (exit status "
                                       "1): ValueError: boom; stopped the others\n")


def test_run_all_environments_success_and_a_killed_process(capsys):
    out = io.StringIO()
    show = "import os; print(os.environ.get('WHO'), os.environ.get('HOME'))"
    assert run_all([[PY, "-c", show]] * 2, [{"WHO": "zero"}, {"WHO": "one"}], out=out) == 0
    assert sorted(out.getvalue().splitlines()) == ["[0] zero None", "[1] one None"]
    kill = f"import os; os.kill(os.getpid(), {int(signal.SIGKILL)})"
    assert run_all([[PY, "-c", kill]], out=io.StringIO()) == 128 + 9
    assert capsys.readouterr().err == ""  # one process: nobody else to blame or stop
