"""The traffic ledger: exact point-to-point bytes, nominal backend collectives, tags, groups, timing events."""
import pickle

import pytest
import torch

from course_lib.distributed.comm import Communicator, Ledger
from course_lib.distributed.launch import LaunchError, launch

pytestmark = pytest.mark.integration


def _p2p(ctx):
    c = ctx.comm
    r, p = ctx.rank, ctx.world_size
    if r == 0:
        c.send(torch.ones(10, dtype=torch.float64), 1, tag="a")          # 80 bytes
        h = c.isend(torch.ones(3, dtype=torch.int16), 1, tag="b")         # 6 bytes
        h.wait()
        h.wait()                                                          # idempotent, recorded once
    elif r == 1:
        buf = torch.empty(10, dtype=torch.float64)
        c.recv(buf, 0, tag="a")
        small = torch.empty(3, dtype=torch.int16)
        c.irecv(small, 0, tag="b").wait()
        assert buf.sum() == 10 and small.sum() == 3
    with c.compute("work"):
        torch.ones(100).sum()
    x = torch.full((12,), float(r))
    c.all_reduce(x, tag="ar")
    out = torch.empty(12 * p)
    c.all_gather(out, torch.full((12,), float(r)), tag="ag")
    rs = torch.empty(12)
    c.reduce_scatter(rs, torch.ones(12 * p), tag="rs")
    bc = torch.full((5,), float(r))
    c.broadcast(bc, src=p - 1, tag="bc")
    avg = torch.full((4,), float(r))
    c.all_reduce(avg, "avg")
    c.barrier()
    return c.ledger, x[0].item(), out.view(p, 12)[:, 0].tolist(), rs[0].item(), bc[0].item(), avg[0].item()


@pytest.mark.parametrize("world_size", [2, 3])
def test_ledger_counts_point_to_point_exactly_and_collectives_nominally(world_size, no_leaks):
    res = launch(_p2p, world_size, timeout=60)
    p = world_size
    for r, (L, ar, ag, rs, bc, avg) in enumerate(res):
        L = pickle.loads(pickle.dumps(L))                                 # ledgers travel between processes
        assert ar == sum(range(p)) and ag == list(map(float, range(p))) and rs == p and bc == p - 1
        assert avg == pytest.approx(sum(range(p)) / p)
        assert L.bytes_sent(tag="a") == (80 if r == 0 else 0) and L.bytes_recv(tag="a") == (80 if r == 1 else 0)
        assert L.bytes_sent(tag="b") == (6 if r == 0 else 0) and L.messages(tag="b") == (1 if r == 0 else 0)
        assert L.bytes_sent(op="all_reduce", tag="ar") == round(2 * (p - 1) / p * 48)
        assert L.bytes_sent(op="all_gather") == (p - 1) * 48 and L.bytes_sent(op="reduce_scatter") == (p - 1) * 48
        assert L.bytes_sent(op="broadcast") == (20 if r == p - 1 else 0)
        assert L.bytes_recv(op="broadcast") == (0 if r == p - 1 else 20)
        assert all(e.nominal for e in L.events if e.kind == "collective")
        assert not any(e.nominal for e in L.events if e.kind in ("send", "recv"))
        assert [e.tag for e in L.events if e.kind == "compute"] == ["work"]
        assert all(e.t1 >= e.t0 for e in L.events)
        table = L.table()
        assert "nominal" in table and "total" in table
        assert L.by("tag")["ar"]["sent"] == L.bytes_sent(tag="ar")


def _subgroups(ctx):
    c = ctx.comm
    even = c.new_group([0, 2], "even")
    odd = c.new_group([1, 3], "odd")
    mine = even or odd
    t = torch.tensor([float(ctx.rank)])
    mine.sendrecv(t.clone(), 1 - mine.rank, t, 1 - mine.rank, tag="swap")
    return mine.name, mine.rank, t.item(), c.ledger.bytes_sent(group=mine.name), c.ledger.bytes_sent(group="world")


def test_subgroups_address_group_ranks_and_share_the_ledger(no_leaks):
    res = launch(_subgroups, 4, timeout=60)
    assert [r[:3] for r in res] == [("even", 0, 2.0), ("odd", 0, 3.0), ("even", 1, 0.0), ("odd", 1, 1.0)]
    assert all(r[3] == 4 and r[4] == 0 for r in res)


def _bad_peer(ctx):
    ctx.comm.send(torch.ones(1), ctx.rank)          # to itself


def _bad_recv_buffer(ctx):
    ctx.comm.recv(torch.ones(4, 4).t(), 1 - ctx.rank)


def _bad_gather(ctx):
    ctx.comm.all_gather(torch.empty(5), torch.ones(2))


@pytest.mark.parametrize("fn, match", [(_bad_peer, "is not another rank"), (_bad_recv_buffer, "contiguous"),
                                       (_bad_gather, "expected world_size")])
def test_bad_calls_raise_errors_that_say_what_to_change(fn, match, no_leaks):
    with pytest.raises(LaunchError, match=match):
        launch(fn, 2, timeout=30)


def test_communicator_outside_ranks_is_a_clear_error():
    with pytest.raises(RuntimeError, match="launch"):
        Communicator()


def test_ledger_prefix_tags_and_reset():
    from course_lib.distributed.comm import Event
    L = Ledger(0, 2)
    L.record(Event("send", "send", "bucket0", 0.0, 1.0, sent=10, peer=1))
    L.record(Event("send", "send", "bucket1", 1.0, 2.0, sent=5, peer=1))
    L.record(Event("recv", "recv", "other", 1.0, 2.0, recv=7, peer=1))
    assert L.bytes_sent(tag="bucket*") == 15 and L.messages(tag="bucket*") == 2 and L.bytes_recv() == 7
    L.reset()
    assert L.bytes_sent() == 0


def test_the_ledgers_running_totals_equal_the_sum_of_its_events():
    """bytes_sent(group=…) reads running totals (probes call it after every phase); they must stay the events' sum
    through record, reset and a ledger built from a slice of another's events."""
    from course_lib.distributed.comm import Event, Ledger
    events = [Event("send", "send", "t", 0.0, 1.0, sent=s, group=g) for s, g in
              ((8, "dp"), (0, "dp"), (16, "tp"), (4, "dp"), (32, "world"))]
    led = Ledger(0, 2)
    for e in events:
        led.record(e)
    for group in (None, "dp", "tp", "world", "pp"):
        assert led.bytes_sent(group=group) == sum(e.sent for e in events if group is None or e.group == group)
    assert Ledger(0, 2, events[2:]).bytes_sent(group="dp") == 4 and Ledger(0, 2, events[2:]).bytes_sent() == 52
    led.reset()
    assert led.bytes_sent() == 0 and led.bytes_sent(group="dp") == 0
