"""transports: every measured path delivers every byte, and nothing (process, port, file descriptor) outlives a
measurement — after a normal run, after a rank raised, after a rank hung. Timings are not asserted here."""
import tempfile
from pathlib import Path

import numpy as np
import psutil
import pytest
import torch

from course_lib import transports as T
from course_lib.distributed import start
from course_lib.distributed.launch import LaunchError, launch
from course_lib.transports import measure

pytestmark = pytest.mark.integration

ODD_SIZES = [1, 7, 4096, 65537, T.MiB, 3_000_001]


def _fds() -> int:
    return psutil.Process().num_fds()


def _shm_names() -> set[str]:
    where = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())
    return {p.name for p in where.glob("course-shm-*")}


@pytest.fixture(params=["fork", "forkserver", "spawn"])
def start_method(request, monkeypatch):
    """Run under each way of starting ranks: the connection, buffer and pipes are made inside the ranks."""
    monkeypatch.setenv(start.ENV, request.param)
    if request.param != "fork":
        launch(lambda ctx: None, 1, timeout=120)   # start the fork server (and resource tracker) before counting fds
    return request.param


def test_every_path_delivers_every_byte_intact(start_method, no_leaks):
    fds, names = _fds(), _shm_names()
    m = T.measure_transports(ODD_SIZES, verify=True, repeats=2, warmup=1, cpu_messages=2, cpu_rounds=3)
    # every message the receiver got was compared with what was sent: per repeat, size and path one untimed warm-up
    # message and `inner` timed ones; then 2 messages per path in each of the 3 CPU rounds
    per_rep = sum(1 + measure._inner(n) for n in ODD_SIZES)
    assert m.verified == {p: 3 * per_rep + 3 * 2 for p in T.PATHS}
    assert _fds() == fds and _shm_names() == names


def test_measurement_has_a_positive_time_per_repeat_and_size_and_cpu_per_round_for_both_sides(no_leaks):
    m = T.measure_transports([8, 1024, 2**20], repeats=2, cpu_messages=2, cpu_rounds=3)
    assert m.paths == T.PATHS and list(m.sizes) == [8, 1024, 2**20]
    for p in T.PATHS:
        assert m.samples[p].shape == (2, 3) and np.all(m.samples[p] > 0)
        # the fastest message of a repeat is at most its median, and the floor is the fastest of them all
        assert m.fastest[p].shape == (2, 3) and np.all(m.fastest[p] > 0) and np.all(m.fastest[p] <= m.samples[p])
        assert m.floor(p, at=1) == m.fastest[p][:, 1].min() <= m.samples[p][:, 1].min()
        assert set(m.cpu[p]) == {"sender", "receiver"} and m.cpu_wall[p].shape == (3,)
        for side in m.cpu[p].values():
            assert side["user"].shape == side["sys"].shape == (3,)
            assert np.all(side["user"] >= 0) and np.all(side["sys"] >= 0)
    assert m.cpu_bytes == 2 * 2**20                    # per path and round: cpu_messages × the largest size
    # the memcpy "receiver" runs no code at all in its blocks: its CPU is the loop around them, far below a copy
    assert m.cpu_per_gb("memcpy", "receiver") < 0.5 * m.cpu_per_gb("memcpy", "sender")


def test_a_subset_of_paths_runs_alone(no_leaks):
    m = T.measure_transports([64, 4096], paths=["shm_write"], verify=True, repeats=1, warmup=0, cpu_messages=1,
                             cpu_rounds=2)
    assert m.paths == ("shm_write",)
    assert m.verified["shm_write"] == 2 + measure._inner(64) + measure._inner(4096) + 2


@pytest.mark.parametrize("method", ["fork", "forkserver"])
def test_a_failing_receiver_raises_and_leaves_no_process_port_or_fd(method, monkeypatch, no_leaks):
    monkeypatch.setenv(start.ENV, method)
    launch(lambda ctx: None, 1, timeout=120)
    fds, names = _fds(), _shm_names()
    with pytest.raises(LaunchError, match="injected fault"):
        T.measure_transports([8, 4096], repeats=1, fault="raise", timeout=20)
    assert _fds() == fds and _shm_names() == names


def test_a_hung_receiver_times_out_and_leaves_no_process_port_or_fd(no_leaks):
    fds = _fds()
    with pytest.raises(LaunchError):          # LaunchTimeout, or the sender's socket timeout, whichever comes first
        T.measure_transports([8, 4096], repeats=1, fault="hang", timeout=4)
    assert _fds() == fds


@pytest.mark.parametrize("bad", [dict(paths=["carrier pigeon"]), dict(sizes=[0, 8]), dict(repeats=0),
                                 dict(cpu_rounds=0), dict(fault="explode")])
def test_bad_arguments_say_what_is_wrong_before_starting_anything(bad, no_leaks):
    kwargs = dict(sizes=[8], repeats=1)
    kwargs.update(bad)
    with pytest.raises(ValueError):
        T.measure_transports(**kwargs)


def test_serial_staged_send_delivers_intact_and_never_overlaps(no_leaks):
    out = T.measure_staged_send({"serial": T.send_staged_serial}, nbytes=3 * T.MiB + 5, chunk_bytes=T.MiB,
                                repeats=2, timeout=30)
    assert out["intact"] == {"serial": True}
    assert out["overlap"]["serial"] == [0.0, 0.0]          # one thread: staging and sending alternate, exactly
    assert len(out["times"]["serial"]) == 2 and out["wire_time"] > 0 and out["staging_bandwidth"] > 0


def test_staged_send_reports_corrupted_bytes(no_leaks):
    def send_zeros(sock, device, bounce, engine):          # stages every byte, then sends the wrong ones
        T.send_staged_serial(sock, torch.zeros_like(device), bounce, engine)
    out = T.measure_staged_send({"zeros": send_zeros}, nbytes=T.MiB, chunk_bytes=256 * 1024, repeats=1, timeout=30)
    assert out["intact"] == {"zeros": False}


def test_staged_send_insists_every_byte_goes_through_the_copy_engine(no_leaks):
    def bypass(sock, device, bounce, engine):
        sock.sendall(memoryview(device.numpy()))
    with pytest.raises(LaunchError, match="every byte must go through the bounce buffer"):
        T.measure_staged_send({"bypass": bypass}, nbytes=T.MiB, chunk_bytes=256 * 1024, repeats=1, timeout=30)
