"""The parameter server of jaxpar launch --replicas, driven through its folder as the
replica processes drive it: joins, rounds, the outer update, members that die."""

import errno
import json

import numpy as np
import pytest

from jaxpar.errors import JaxparError
from jaxpar.runs.replicas import START, ParameterServer, _read, _write, read_state


def _server(tmp_path, **kw) -> ParameterServer:
    return ParameterServer(tmp_path, outer_lr=kw.get("lr", 0.7),
                           outer_momentum=kw.get("mu", 0.9), nesterov=kw.get("nesterov", True),
                           staleness=kw.get("tau", 0))


def _join(folder, r: int, w: np.ndarray) -> None:
    _write(folder / f"join_{r}_t{r}.npz", {"w": w})


def _send(folder, k: int, r: int, w: np.ndarray) -> None:
    (folder / f"round_{k}").mkdir(exist_ok=True)
    _write(folder / f"round_{k}" / f"replica_{r}.npz", {"w": w})


def test_rounds_apply_outer_nesterov_sgd_to_the_mean_delta(tmp_path):
    server = _server(tmp_path)
    start = np.ones(3, np.float32)
    for r in (0, 1):
        _join(tmp_path, r, start)
    assert server.poll({0, 1}) == []
    assert json.loads((tmp_path / "welcome_0_t0.json").read_text()) == {"round": 0}
    np.testing.assert_array_equal(_read(tmp_path / "round_0" / "anchor.npz")["w"], start)
    _send(tmp_path, 1, 0, start - 0.1)
    assert server.poll({0, 1}) == []  # replica 1 has not written yet
    _send(tmp_path, 1, 1, start - 0.3)
    assert server.poll({0, 1}) == ["round 1: replicas [0, 1] met"]
    g = 0.2  # anchor - mean(weights)
    m = g
    want = start - 0.7 * (g + 0.9 * m)
    np.testing.assert_allclose(_read(tmp_path / "round_1" / "anchor.npz")["w"], want,
                               rtol=1e-6)


def test_a_dead_member_is_dropped_and_a_restarted_one_rejoins(tmp_path):
    server = _server(tmp_path, lr=1.0, mu=0.0, nesterov=False)
    w = np.zeros(2, np.float32)
    for r in (0, 1, 2):
        _join(tmp_path, r, w)
    server.poll({0, 1, 2})
    _send(tmp_path, 1, 0, w + 1)
    _send(tmp_path, 1, 1, w + 3)
    said = server.poll({0, 1})  # replica 2 died before writing round 1
    assert said[0] == "replica 2 is gone; round 1 goes on with [0, 1]"
    assert said[-1] == "round 1: replicas [0, 1] met"
    np.testing.assert_allclose(_read(tmp_path / "round_1" / "anchor.npz")["w"], w + 2)
    _write(tmp_path / "join_2_again.npz", {"w": w})
    assert server.poll({0, 1, 2}) == [
        "replica 2 rejoined: it loads round 1's anchor and meets from round 2"]
    assert json.loads((tmp_path / "welcome_2_again.json").read_text()) == {"round": 1}
    for r in (0, 1):
        _send(tmp_path, 2, r, w)
    assert server.poll({0, 1, 2}) == []  # round 2 waits for the rejoined replica
    _send(tmp_path, 2, 2, w)
    assert server.poll({0, 1, 2}) == ["round 2: replicas [0, 1, 2] met"]


def test_the_first_round_waits_for_every_replica_to_join(tmp_path):
    server = _server(tmp_path)
    _join(tmp_path, 0, np.zeros(1, np.float32))
    server.poll({0, 1})
    _send(tmp_path, 1, 0, np.zeros(1, np.float32))
    assert server.poll({0, 1}) == []
    assert not (tmp_path / "round_1" / "anchor.npz").exists()


def test_server_state_is_saved_each_round(tmp_path):
    """With its H (sync_every); stray files in meetings/ (a join_x.npz, a round_1/notes.npz,
    a round_old/replica_0.npz) are left alone; a resume finds the round and H."""
    server = _server(tmp_path)
    server.sync_every = 3
    _join(tmp_path, 0, np.zeros(1, np.float32))
    _write(tmp_path / "join_x.npz", {"w": np.zeros(1)})
    server.poll({0})
    _send(tmp_path, 1, 0, np.ones(1, np.float32))
    _write(tmp_path / "round_1" / "notes.npz", {"w": np.zeros(1)})
    (tmp_path / "round_old").mkdir()
    _write(tmp_path / "round_old" / "replica_0.npz", {"w": np.zeros(1)})
    assert server.poll({0}) == ["round 1: replicas [0] met"]
    saved = _read(tmp_path / "server.npz")
    assert int(saved["round"]) == 1 and {"anchor/w", "momentum/w"} <= set(saved)
    assert read_state(tmp_path)["sync_every"] == 3
    again = _server(tmp_path)
    again.sync_every = 3
    with pytest.raises(JaxparError, match="round_old is not a meeting's folder"):
        again.restore()
    (tmp_path / "round_old" / "replica_0.npz").unlink()
    (tmp_path / "round_old").rmdir()
    assert again.restore() == 1


def test_bounded_staleness_goes_on_without_a_slow_replica_and_applies_it_late(tmp_path):
    """tau = 1: round 2 completes with replica 0 alone (replica 1 wrote round 1); replica
    1's round-2 weights, trained from round 1's anchor, join round 3's average; a replica
    two rounds behind is waited for."""
    server = _server(tmp_path, lr=1.0, mu=0.0, nesterov=False, tau=1)
    w = np.zeros(1, np.float32)
    for r in (0, 1):
        _join(tmp_path, r, w)
    server.poll({0, 1})
    _send(tmp_path, 1, 0, w + 2)
    _send(tmp_path, 1, 1, w + 4)
    assert server.poll({0, 1}) == ["round 1: replicas [0, 1] met"]  # anchor 3
    _send(tmp_path, 2, 0, w + 5)
    assert server.poll({0, 1}) == ["round 2: replicas [0] met"]  # anchor 5
    np.testing.assert_allclose(_read(tmp_path / "round_2" / "anchor.npz")["w"], w + 5)
    _write(tmp_path / "round_2" / "replica_1.npz", {"w": w + 4, START: np.asarray(1)})
    _send(tmp_path, 3, 0, w + 6)
    assert server.poll({0, 1}) == ["round 3: replicas [0] met (late from earlier rounds: [1])"]
    # outer gradients: replica 0 from anchor 5 to 6 (-1), replica 1 from anchor 3 to 4 (-1)
    np.testing.assert_allclose(_read(tmp_path / "round_3" / "anchor.npz")["w"], w + 6)
    _send(tmp_path, 4, 0, w + 7)
    assert server.poll({0, 1}) == []  # replica 1's last round, 2, is two behind round 4
    assert server.round == 3


def test_a_damaged_meeting_file_is_left_out_in_one_line(tmp_path):
    """Replica 1's weights for round 1 damaged after they were written: the round
    completes with replica 0's alone, and says which file it left out and why."""
    server = _server(tmp_path, mu=0.0)
    start = np.ones(3, np.float32)
    for r in (0, 1):
        _join(tmp_path, r, start)
    server.poll({0, 1})
    _send(tmp_path, 1, 0, start - 0.1)
    _send(tmp_path, 1, 1, start - 0.3)
    damaged = tmp_path / "round_1" / "replica_1.npz"
    damaged.write_bytes(damaged.read_bytes()[:40])
    said = server.poll({0, 1})
    assert said[0].startswith(f"round 1: {damaged} is unreadable (") and said[0].endswith(
        "; left out")
    assert said[1] == "round 1: replicas [0, 1] met"
    np.testing.assert_allclose(_read(tmp_path / "round_1" / "anchor.npz")["w"],
                               start - 0.7 * 0.1, rtol=1e-6)
    with pytest.raises(JaxparError, match="is unreadable"):
        _read(damaged)


def test_a_full_disk_is_one_line_and_leaves_no_temporary_file(tmp_path, monkeypatch):
    def full(*_, **__):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(np, "savez", full)
    with pytest.raises(JaxparError, match="meetings: cannot write .*anchor.npz: No space "
                                          "left on device; the rounds before it are intact"):
        _write(tmp_path / "anchor.npz", {"w": np.ones(2)})
    assert list(tmp_path.iterdir()) == []
