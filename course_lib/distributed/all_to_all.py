"""All-to-all from send/recv: rank i hands rank j its own piece `inputs[j]` and receives `outputs[i]` from every
rank — the collective expert parallelism moves tokens with (GShard, Lepikhin et al., arXiv 2006.16668, §2.2;
Switch Transformer, Fedus et al., JMLR 2022).

Pairwise exchange (the schedule MPI libraries use for large messages, Thakur, Rabenseifner & Gropp 2005 §4.3): in
step k = 1 … p−1 rank r sends to r+k and receives from r−k, so every pair talks once and no rank receives two
messages at a time; its own piece is a local copy. Pieces may have different lengths (uneven splits): the
lengths along dim 0 are exchanged first as one int64 per peer, under the tag `<tag>:sizes`, so a receiver knows
what buffer to post. Bytes rank r sends, exactly (docs/formulas.md §12):

    Σ_{j ≠ r} inputs[j].numel() · e              plus 8·(p − 1) bytes of sizes (when the sizes are not known)

`AllToAll` makes it differentiable: the backward of an all-to-all is the all-to-all of the gradients with the
splits reversed. `torch.distributed.all_to_all_single` is the backend's own, the reference it is checked against.
"""
from __future__ import annotations

import torch


def all_to_all(comm, inputs, *, tag: str = "all_to_all", out_sizes=None) -> list:
    """`inputs[j]` (a tensor whose dim 0 may differ per j; the other dims alike) goes to rank j of `comm`; returns
    the list of what each rank sent here. `out_sizes` (dim-0 lengths to expect from each rank) skips the size
    exchange when the caller knows them."""
    p, r = comm.world_size, comm.rank
    inputs = [t.contiguous() for t in inputs]
    if len(inputs) != p:
        raise ValueError(f"all_to_all needs one piece per rank: {p} ranks, {len(inputs)} pieces")
    if out_sizes is None:
        out_sizes = exchange_sizes(comm, [t.shape[0] for t in inputs], tag=f"{tag}:sizes")
    rest = inputs[r].shape[1:]
    out = [None] * p
    out[r] = inputs[r].clone()
    for k in range(1, p):
        dst, src = (r + k) % p, (r - k) % p
        buf = torch.empty((int(out_sizes[src]), *rest), dtype=inputs[r].dtype)
        send = comm.isend(inputs[dst], dst, tag=tag) if inputs[dst].numel() else None
        recv = comm.irecv(buf, src, tag=tag) if buf.numel() else None
        for h in (recv, send):
            if h is not None:
                h.wait()
        out[src] = buf
    return out


def exchange_sizes(comm, sizes, *, tag: str = "all_to_all:sizes") -> list:
    """Each rank tells every other how many rows it will send it: returns the rows this rank will receive from each."""
    p, r = comm.world_size, comm.rank
    got = [0] * p
    got[r] = int(sizes[r])
    for k in range(1, p):
        dst, src = (r + k) % p, (r - k) % p
        buf = torch.zeros(1, dtype=torch.int64)
        send = comm.isend(torch.tensor([int(sizes[dst])], dtype=torch.int64), dst, tag=tag)
        comm.irecv(buf, src, tag=tag).wait()
        send.wait()
        got[src] = int(buf.item())
    return got


class AllToAll(torch.autograd.Function):
    """y = all_to_all(x split into `send_sizes` rows per rank) concatenated; backward: the reverse all-to-all."""

    @staticmethod
    def forward(ctx, x, comm, send_sizes, recv_sizes, tag):
        ctx.comm, ctx.send_sizes, ctx.recv_sizes, ctx.tag = comm, list(send_sizes), list(recv_sizes), tag
        parts = all_to_all(comm, list(x.split(list(send_sizes))), tag=tag, out_sizes=recv_sizes)
        return torch.cat(parts)

    @staticmethod
    def backward(ctx, grad):
        parts = all_to_all(ctx.comm, list(grad.contiguous().split(ctx.recv_sizes)), tag=f"{ctx.tag}.bwd",
                           out_sizes=ctx.send_sizes)
        return torch.cat(parts), None, None, None, None


def all_to_all_bytes(send_rows, rank: int, row_numel: int, elem: int) -> int:
    """Bytes `rank` sends in one all-to-all of `send_rows[j]` rows (of `row_numel` elements) to each rank j."""
    return sum(n for j, n in enumerate(send_rows) if j != rank) * row_numel * elem


__all__ = ["all_to_all", "exchange_sizes", "AllToAll", "all_to_all_bytes"]
