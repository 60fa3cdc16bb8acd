"""Real ranks and what travels between them.

    launch            processes joined by torch.distributed, with timeouts and every rank's traceback
    start             how ranks start (fork, a fork server, spawn: per platform or $COURSE_START_METHOD) and how a
                      worker defined in a notebook cell travels to them (by value)
    rank              what runs inside each rank: the rendezvous, the parent-death watch, the worker's result
    comm              the traffic ledger: a communicator that records bytes per rank, op, tag and group
    mesh              the rank mesh (pp × dp × cp × tp, ep inside dp): one communicator per axis, one ledger
    collectives       broadcast / reduce / all-reduce / all-gather / reduce-scatter built from send/recv
    collective_bytes  what each collective sends, rank by rank, in closed form (one source with the algorithms)
    all_to_all        all-to-all from send/recv (the exchange expert parallelism moves tokens with)
    flat              flat buffers: parameters or gradients laid end to end, bucketed by bytes, padded and sharded
"""
