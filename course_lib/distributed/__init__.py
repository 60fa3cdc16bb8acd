"""Real ranks and what travels between them.

    launch       processes joined by torch.distributed, with timeouts and every rank's traceback
    comm         the traffic ledger: a communicator that records bytes per rank, op, tag and group
    mesh         the rank mesh (pp × dp × tp): one communicator per axis, all on the same ledger
    collectives  broadcast / reduce / all-reduce / all-gather / reduce-scatter built from send/recv
    flat         flat buffers: parameters or gradients laid end to end, bucketed by bytes, padded and sharded
all_to_all   all-to-all from send/recv (the exchange expert parallelism moves tokens with)
collective_bytes  what each collective sends, rank by rank, in closed form (one source with the algorithms)
"""
