"""The checkpoint mechanism: keep a segment's inputs, recompute in backward what it saved (Chen et al. 2016).

Saved-tensor hooks (as `torch.utils.checkpoint(use_reentrant=False)`), plus a record of the ops:

    forward   the segment runs as usual, with grad. Every tensor autograd saves passes through our pack hook: made
              outside the segment (its input, the weights) → kept; made inside → a Ticket instead, unless the policy
              keeps what that op makes. A dispatch mode records every op: which storages it read and wrote, and the
              RNG state just before each random op.
    backward  the first Ticket autograd hands back reruns the segment's forward from its kept input. Only the ops
              the tickets depend on execute (the RNG state restored before each random op: the same dropout mask),
              and every collective before the last of them (a tensor-parallel block's all-reduce is part of its
              recomputed forward, and the other ranks rerun it too); an op the policy keeps hands back its kept
              output and the segment lets go of it; every other op returns an empty stand-in; the rerun stops
              after the last op a ticket needs (early stop). A recomputed tensor is let go once handed back.

Policies: `course_lib.memopt.recompute.policies`; plans over a model's blocks: `course_lib.memopt.recompute`.
"""
from __future__ import annotations

import contextlib
import contextvars
import weakref
from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_unflatten

from ...memory import _active, _Outer, register_category, saved_tensors_hooks_over, untracked
from .policies import recompute_all

aten = torch.ops.aten
RECOMPUTED = register_category("recomputed", "#E8A0A0")    # tensors a rerun made, until backward has used them

_VIEW_LIKE = {aten._unsafe_view.default}                     # shares its input's storage but is not marked a view
_SHAPE_ONLY = {aten.empty_like.default}                      # reads only the shape of its argument
_COLLECTIVES = {"c10d", "_c10d_functional", "c10d_functional"}   # side effects on other ranks: always rerun


class CheckpointError(RuntimeError):
    """A segment cannot be recomputed faithfully; the message says why and what to change."""


_open: contextvars.ContextVar = contextvars.ContextVar("course_recompute_open", default=None)
_rerunning: contextvars.ContextVar = contextvars.ContextVar("course_recompute_rerunning", default=False)


class _Stop(Exception):
    """Raised inside the rerun after the last op a ticket needs: the rest of the forward is not run."""


def _key(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


def _meta(t: torch.Tensor) -> tuple:
    return tuple(t.shape), t.stride(), t.storage_offset(), t.dtype, t.device


@dataclass
class _Op:
    """One op the segment ran in forward (views are not recorded: they make no storage)."""
    func: object
    recompute: bool                       # the policy's answer for this op
    reads: list                           # (sid, writer) for every storage made in the segment that it read
    writes: list                          # (sid, ("out" | "arg", flat index)) storages it made or changed in place
    outs: list                            # per flattened output: None, or (meta, sid or None, aliased arg or None)
    out_spec: object
    rng: object = None                    # generator state before a random op (None: not random)
    random: bool = False
    forced: bool = False                  # collectives and ops returning Python values always rerun
    run: bool = False                     # decided at the end of forward: execute in the rerun
    collect: list = field(default_factory=list)   # (sid, where) of tickets this op makes again


class Ticket:
    """What autograd keeps instead of a tensor the segment will recompute: (segment, storage, view), and the Python
    attributes an inner saved-tensor hook left on it (sequence parallelism's note to gather its slice again)."""
    __slots__ = ("segment", "sid", "view", "notes", "taken", "__weakref__")

    def __init__(self, segment, sid, t):
        self.segment = segment
        self.sid = sid
        self.view = (tuple(t.shape), t.stride(), t.storage_offset())
        self.notes = dict(t.__dict__) if t.__dict__ else None
        self.taken = False

    def __del__(self):
        if not self.taken:
            self.segment._ticket_gone(self.sid)


class Segment:
    """One checkpointed segment: `with Segment(fn, args, policy=...): out = fn(*args)` (see the module docstring).
    `name` appears in errors; `preserve_rng_state=False` is refused when the segment recomputes a random op."""

    def __init__(self, fn, args, *, policy=recompute_all, preserve_rng_state: bool = True, name: str = "segment"):
        self.fn = fn
        self.policy = policy
        self.preserve_rng_state = preserve_rng_state
        self.name = name
        # detached aliases (same storage and version counter): a reference to a tensor with a grad_fn, held by
        # something its graph holds (our Tickets), would be a cycle through C++ that Python's GC cannot free
        self.inputs = tuple(a.detach() if isinstance(a, torch.Tensor) else a for a in args)
        self.requires_grad = [isinstance(a, torch.Tensor) and a.requires_grad for a in args]
        self.versions = [a._version if isinstance(a, torch.Tensor) else None for a in self.inputs]
        self.ops: list[_Op] = []
        self.live: dict[int, int] = {}        # storage key -> sid, for storages made in the segment and alive
        self.writer: list[int] = []           # sid -> index of the op that last wrote it
        self.alloc: list[int] = []            # sid -> index of the op that made it
        self.held: dict[int, torch.Tensor] = {}   # sid -> tensor a kept op made that a recomputed op read
        self.dropped: dict[int, int] = {}     # sid -> writer, for every storage a Ticket stands for
        self.tickets: dict[int, int] = {}     # sid -> live Tickets
        self.recomputed: dict[int, torch.Tensor] = {}
        self.sources: dict[int, torch.Tensor] = {}    # sid -> kept tensor the rerun hands back instead of recomputing
        self.packed: list = []                # inputs, passed through the enclosing saved-tensor hooks
        self.packed_sources: dict = {}        # sid -> a source, passed through them (so a tracker counts it)
        self._finalizers: list = []           # weakref.finalize per storage made in the segment, until it ends
        self._stack = None                    # the hooks and the recorder, entered by __enter__
        self._outer = None                    # the saved-tensor hooks around the segment (a tracker), if any
        self._recorder = None
        self.last = -1                        # the index of the last op the rerun executes
        self.done = False                     # the rerun has run

    # ---------------------------------------------------------------------------------------- forward
    def __enter__(self):
        if _open.get() is not None:
            raise CheckpointError(f"{self.name} starts while {_open.get().name} is still open: segments cannot nest; "
                                  f"checkpoint the outer segment only")
        self._outer = outer = torch._C._autograd._top_saved_tensors_default_hooks(False)
        if outer is not None:           # so a memory tracker counts the kept inputs as activations
            self.packed = [outer[0](a) for a in self.inputs if isinstance(a, torch.Tensor)]
        self._stack = contextlib.ExitStack()
        self._stack.enter_context(saved_tensors_hooks_over(self.pack, _unpack))
        self._recorder = self._stack.enter_context(Recorder(self))
        self._token = _open.set(self)
        return self

    def __exit__(self, *exc):
        _open.reset(self._token)
        self._stack.close()
        for f in self._finalizers:          # storages outlive the segment (its output): stop watching them
            f.detach()
        self._finalizers = []
        self.live = {}
        self._outer = None
        self._recorder = None
        if exc[0] is None:
            self.plan_rerun()
        else:
            self._release()
        return False

    def _record(self, func, args, kwargs):
        flat = tree_flatten((args, kwargs))[0]
        recompute = bool(self.policy(func, *args, **kwargs))
        reads = []
        if func not in _SHAPE_ONLY:
            for t in flat:
                if isinstance(t, torch.Tensor) and (sid := self.live.get(_key(t))) is not None:
                    reads.append((sid, self.writer[sid]))
                    if (recompute or func.namespace in _COLLECTIVES) and not self.ops[self.writer[sid]].recompute:
                        if sid not in self.held:         # a recomputation may need what a kept op made
                            self.held[sid] = t.detach()
        mutated = _mutated_positions(func, args, kwargs, flat)
        random = torch.Tag.nondeterministic_seeded in func.tags
        rng = _rng_state(kwargs) if random and self.preserve_rng_state else None
        out = func(*args, **kwargs)
        k = len(self.ops)
        writes, outs = [], []
        for j in mutated:
            sid = self.live.get(_key(flat[j]))
            if sid is None:
                raise CheckpointError(f"{self.name}: {func} changes a tensor made outside the segment in place; "
                                      f"recomputing would change it again: do it outside the checkpointed segment")
            self.writer[sid] = k
            writes.append((sid, ("arg", j)))
            if recompute:
                self.held.pop(sid, None)
        arg_keys = {_key(t): j for j, t in enumerate(flat) if isinstance(t, torch.Tensor)}
        out_flat, out_spec = tree_flatten(out)
        forced = func.namespace in _COLLECTIVES
        for j, t in enumerate(out_flat):
            if not isinstance(t, torch.Tensor):
                outs.append(None)
                forced = forced or t is not None           # a Python value: the forward may branch on it
                continue
            key = _key(t)
            if key in arg_keys:                            # an in-place op returns its argument
                outs.append((_meta(t), None, arg_keys[key]))
                continue
            sid = len(self.writer)
            self.writer.append(k)
            self.alloc.append(k)
            self.live[key] = sid
            self._finalizers.append(weakref.finalize(t.untyped_storage(), self.live.pop, key, None))
            writes.append((sid, ("out", j)))
            outs.append((_meta(t), sid, None))
        self.ops.append(_Op(func, recompute, reads, writes, outs, out_spec, rng, random, forced))
        return out

    def pack(self, t: torch.Tensor):
        sid = self.live.get(_key(t))
        if sid is None or not self.ops[self.writer[sid]].recompute:
            return self._keep(t)                       # an input, a weight, or what a kept op made: kept
        self.dropped[sid] = self.writer[sid]
        self.tickets[sid] = self.tickets.get(sid, 0) + 1
        return Ticket(self, sid, t)

    def _keep(self, t: torch.Tensor):
        """A kept tensor, passed to the saved-tensor hooks around (a tracker, an offload): their ops go unrecorded."""
        if self._outer is None:
            return t
        self._recorder.paused = True
        packed = _Outer(self._outer[1], self._outer[0](t))
        self._recorder.paused = False
        return packed

    def plan_rerun(self) -> None:
        """End of forward: which ops the rerun must execute (the tickets' ancestors, back to what is kept)."""
        if not self.dropped:
            self._release()
            return
        blocked: set = set()      # kept storages whose maker itself reruns: their content must be rebuilt
        while True:
            run, sources = set(), set()
            stack = list(self.dropped.values())
            while stack:
                while stack:
                    k = stack.pop()
                    if k in run:
                        continue
                    run.add(k)
                    for sid, w in self.ops[k].reads:
                        if sid in self.held and self.writer[sid] == w and sid not in blocked:
                            sources.add(sid)           # handed back from the kept tensor, not recomputed
                        else:
                            stack.append(w)
                # collectives before the last op rerun too (other ranks do), with what they read
                stack = [i for i in range(max(run)) if self.ops[i].forced and i not in run]
            bad = {sid for sid in sources if self.alloc[sid] in run}
            if not bad:
                break
            blocked |= bad
        random = [self.ops[k].func for k in sorted(run) if self.ops[k].random]
        if random and not self.preserve_rng_state:
            self._release()
            raise CheckpointError(f"{self.name} recomputes the random op {random[0]} but preserve_rng_state=False: the "
                                  f"rerun would draw a different dropout mask and the gradients would silently differ. "
                                  f"Keep preserve_rng_state=True")
        self.last = max(run)
        for k in run:
            self.ops[k].run = True
        for sid, w in self.dropped.items():
            self.ops[w].collect.extend((s, where) for s, where in self.ops[w].writes if s == sid)
        self.sources = {sid: self.held[sid] for sid in sources}
        self.held = {}
        outer = torch._C._autograd._top_saved_tensors_default_hooks(False)
        if outer is not None:       # what the rerun hands back is kept for backward: activations
            self.packed_sources = {sid: outer[0](t) for sid, t in self.sources.items()}
        del self.ops[self.last + 1:]
        for op in self.ops:
            op.reads = op.writes = None

    # ---------------------------------------------------------------------------------------- backward
    def _get(self, ticket: Ticket) -> torch.Tensor:
        if ticket.taken:
            raise CheckpointError(f"a tensor {self.name} recomputed is unpacked twice (retain_graph=True): the rerun "
                                  f"hands each back once, as torch's checkpoint does; run forward for each backward")
        if not self.done:
            self._rerun()
        size, stride, offset = ticket.view
        with torch.no_grad():
            t = self.recomputed[ticket.sid].as_strided(size, stride, offset)
        if ticket.notes:
            t.__dict__.update(ticket.notes)
        ticket.taken = True         # autograd's reference alone now decides how long it lives (as in torch's)
        self._ticket_gone(ticket.sid)
        return t

    def _rerun(self) -> None:
        for a, v in zip(self.inputs, self.versions):
            if v is not None and a._version != v:
                raise CheckpointError(f"the input of {self.name} was changed in place after the forward pass; its "
                                      f"recomputation would start from different values")
        state = torch.get_rng_state()
        replay = Replay(self)
        inputs = [a.detach().requires_grad_(r) if isinstance(a, torch.Tensor) else a
                  for a, r in zip(self.inputs, self.requires_grad)]
        token = _rerunning.set(True)
        try:
            # with grad, as in forward (some ops decompose differently without); nothing the rerun saves is kept
            with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(_discard, _discard), replay:
                self.fn(*inputs)
        except _Stop:
            pass
        else:
            raise CheckpointError(f"recomputing {self.name} ran {replay.i} ops and returned before op {self.last} "
                                  f"({self.ops[self.last].func}): its forward must depend only on its inputs")
        finally:
            _rerunning.reset(token)
            torch.set_rng_state(state)
        for tracker in _active.get():
            tracker.track(list(self.recomputed.values()), RECOMPUTED)
        self.done = True
        self._release()

    def _ticket_gone(self, sid: int) -> None:
        """One ticket of `sid` handed back or dropped; the recomputed tensor goes with the last."""
        self.tickets[sid] -= 1
        if not self.tickets[sid]:
            self.recomputed.pop(sid, None)

    def _release(self) -> None:
        self.inputs = ()
        self.held = {}
        self.sources = {}
        self.packed = []
        self.packed_sources = {}
        self.ops = []

    def _stand_in(self, out, flat):
        """What the rerun returns for one output of an op it does not execute (`out` as recorded in `_Op.outs`):
        nothing, the argument an in-place op returns, the kept tensor, or an empty stand-in on the meta device."""
        if out is None:
            return None
        meta, sid, aliased = out
        if aliased is not None:
            return flat[aliased]
        if sid in self.sources:
            return self._hand_back(sid, meta)
        size, stride, _, dtype, _ = meta
        return torch.empty_strided(size, stride, dtype=dtype, device="meta")

    def _hand_back(self, sid: int, meta) -> torch.Tensor:
        """A kept tensor, for the one op of the rerun that made it in forward; the segment keeps it no longer, so
        it is freed after its last use in the rerun (or when backward is done with it, if autograd saved it too)."""
        self.packed_sources.pop(sid, None)
        return self.sources.pop(sid).as_strided(*meta[:3])


def _unpack(x):
    return x.segment._get(x) if isinstance(x, Ticket) else x


def _discard(x):
    return None


def _mutated_positions(func, args, kwargs, flat) -> list:
    """Flattened positions of the tensors `func` writes in place (schema arguments marked `Tensor(a!)`)."""
    written = []
    for i, arg in enumerate(func._schema.arguments):
        if arg.alias_info is not None and arg.alias_info.is_write:
            value = args[i] if i < len(args) else kwargs.get(arg.name)
            written += [t for t in tree_flatten(value)[0] if isinstance(t, torch.Tensor)]
    ids = {id(t) for t in written}
    return [j for j, t in enumerate(flat) if isinstance(t, torch.Tensor) and id(t) in ids]


def _rng_state(kwargs):
    gen = kwargs.get("generator")
    with untracked():               # bookkeeping of the checkpoint, not memory the model uses
        return (gen, gen.get_state()) if gen is not None else (None, torch.get_rng_state())


def _set_rng(rng) -> None:
    generator, state = rng
    if generator is not None:
        generator.set_state(state)
    else:
        torch.set_rng_state(state)


class Recorder(TorchDispatchMode):
    """The forward's record: every op the segment runs goes through `Segment._record` (views make no storage and
    are not recorded; `paused` while the hooks around the segment pack a kept tensor)."""

    def __init__(self, segment: Segment):
        super().__init__()
        self.segment = segment
        self.paused = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.is_view or func in _VIEW_LIKE or self.paused:
            return func(*args, **kwargs)
        return self.segment._record(func, args, kwargs)


class Replay(TorchDispatchMode):
    """The rerun: executes the ops marked `run`, hands back kept tensors, returns empty stand-ins for the rest."""

    def __init__(self, segment: Segment):
        super().__init__()
        self.segment = segment
        self.i = 0                            # the index of the next op, in the forward's order

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.is_view or func in _VIEW_LIKE:
            with untracked():
                return func(*args, **kwargs)
        seg, i = self.segment, self.i
        self.i += 1
        if i > seg.last or seg.ops[i].func != func:
            raise CheckpointError(f"recomputing {seg.name}: op {i} is {func}, but the forward pass ran "
                                  f"{seg.ops[i].func if i <= seg.last else 'fewer ops'} there. The segment's forward "
                                  f"must depend only on its inputs: no branches on global state, and no module hooks "
                                  f"that act differently in backward (ZeRO-3/FSDP gathering parameters)")
        op = seg.ops[i]
        flat = tree_flatten((args, kwargs))[0]
        if not op.run:
            with untracked():
                outs = [seg._stand_in(m, flat) for m in op.outs]
            return tree_unflatten(outs, op.out_spec)
        if func in _SHAPE_ONLY:        # needs only the recorded shape: no need to rebuild its argument
            (size, stride, _, dtype, device), _, _ = op.outs[0]
            out = torch.empty_strided(size, stride, dtype=dtype, device=device)
        else:
            if op.rng is not None:
                _set_rng(op.rng)
            out = func(*args, **kwargs)
        out_flat = tree_flatten(out)[0]
        for sid, (where, j) in op.collect:
            if seg.tickets.get(sid):           # a ticket autograd already dropped needs nothing back
                seg.recomputed[sid] = (flat[j] if where == "arg" else out_flat[j]).detach()
        if i == seg.last:
            raise _Stop
        return out


def checkpoint(fn, *args, policy=recompute_all, preserve_rng_state: bool = True, name: str = "segment"):
    """fn(*args), keeping only its inputs (and what `policy` keeps) for backward; see the module docstring."""
    if not torch.is_grad_enabled() or _rerunning.get():
        return fn(*args)
    with Segment(fn, args, policy=policy, preserve_rng_state=preserve_rng_state, name=name):
        return fn(*args)


__all__ = ["CheckpointError", "Segment", "Ticket", "Recorder", "Replay", "checkpoint", "RECOMPUTED"]
