"""`ParallelPlan`: every parallelism and memory technique of the course, as one frozen description of a training
step — and `check`, which says before any rank starts whether the combination can work, and if not, what to change.

    plan = ParallelPlan(pp=2, dp=2, tp=2, zero=1, schedule="1f1b", num_microbatches=4, recompute="selective",
                        precision="bf16")
    plan.check(get_config("nano"), world_size=8, batch_size=16)     # raises PlanError, one line, naming the fix

The fields, and the notebook that builds each technique:

    dp, tp, pp          mesh axis sizes (pp × dp × cp × tp, tp innermost: `course_lib.distributed.mesh`)     03, 06, 05
    cp, cp_layout       context parallelism: each cp rank holds T/cp of every sequence ('zigzag' or
                        'contiguous'); gradients reduced over dp × cp; composes with pp (each stage's
                        ring over the cp peers holding it) and tp (the ring on the heads this tp rank
                        holds; SP splits the cp rank's T/cp tokens further)                            12
    ep                  expert parallelism: the experts of every MoE layer over ep of the dp ranks;
                        with tp each tp rank holds its ep share of the experts whole (expert-tensor-
                        parallel size 1: the tp ranks route the same tokens to the same experts; with SP
                        each routes its T/tp slice, their gradients summed over tp); with
                        cp each rank routes its own tokens; in a pipeline each stage's ep group; ZeRO-1/2
                        shard the experts' optimizer state over edp (the ranks holding the same ones)   12
    zero                0 = DDP, 1/2 = ZeRO-1/2 (optimizer state / + gradients sharded), 3 = FSDP         03, 04
    dp_kind             with zero=0: which DDP reduces the gradients ('naive' | 'bucket' | 'overlap')   03
    fsdp_replicate      with zero=3: parameters left whole on every dp rank ('norms+biases', or a
                        size in elements below which a parameter is not sharded)                      04
    schedule, chunks    pipeline schedule ('gpipe' | '1f1b' | 'interleaved' | 'zb_h1', or a generator
                        fn(S, M) of per-rank op lists, as a lab writes one) and virtual stages per
                        rank (interleaved only)                                                       05
    layers              blocks per pipeline stage (e.g. (3, 1)), None: as even as possible            05
    num_microbatches        M: each dp rank splits its share of a step into M micro-batches; with pp > 1
                        the pipeline runs them, with pp = 1 they are accumulated (gradient
                        accumulation) before one reduction                                             03, 05
    sequence_parallel   Korthikanti's SP inside the tp group (LayerNorm regions split along T)         06
    recompute           None | 'full' | 'selective' | 'every' | 'sqrt' (activation recomputation), or a
                        RecomputePlan of the blocks that run on each rank                             08
    precision           None (the model's own dtype, e.g. float64 for exact checks) | 'fp32' | 'bf16'
                        | 'fp16' (fp32 master weights; fp16 with a dynamic loss scale)                 09
    offload_activations vDNN-style activation offload of the blocks that run here                      07
    offload_optimizer   None | 'host' (ZeRO-Offload) | 'disk' (ZeRO-Infinity's SSD tier)              07

`check` only reads sizes: it needs the model config, the world size and (optionally) the global batch, never a
rank, so a notebook, a test or `parallelize` itself calls it first and nothing waits on a rank that was never
going to work. Every combination the course cannot run is refused here, with the reason (e.g. ZeRO-3 inside a
pipeline: it would all-gather every stage's parameters once per micro-batch).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, fields, replace

from ..memopt.offload.optimizer import TIERS
from ..memopt.precision.recipes import RECIPES
from ..memopt.recompute import POLICIES, RecomputePlan
from ..parallel.dp import DP_KINDS as _DP_KINDS
from ..parallel.fsdp import REPLICATION_RULES
from ..parallel.pipeline.schedules import GENERATORS

# Each option's names belong to its technique; the plan offers exactly those (a name added there is accepted here).
SCHEDULES = tuple(GENERATORS)
RECOMPUTE = tuple(p for p in POLICIES if p != "none")       # None is the plan's "no recomputation"
PRECISIONS = tuple(RECIPES)
OPTIMIZER_TIERS = TIERS
REPLICATE = tuple(REPLICATION_RULES)
DP_KINDS = tuple(_DP_KINDS)


class PlanError(ValueError):
    """A plan that cannot work; the message names the parameter and the fix."""


def _is_recompute_plan(value) -> bool:
    return isinstance(value, RecomputePlan)


def _positive_int(name: str, value) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise PlanError(f"ParallelPlan.{name} must be a positive integer, got {value!r}")


@dataclass(frozen=True)
class ParallelPlan:
    dp: int = 1
    tp: int = 1
    pp: int = 1
    cp: int = 1
    cp_layout: str = "zigzag"
    ep: int = 1
    zero: int = 0
    dp_kind: str = "bucket"
    fsdp_replicate: str | int | None = None
    schedule: str = "1f1b"
    chunks: int = 1
    layers: tuple | None = None
    num_microbatches: int = 1
    sequence_parallel: bool = False
    recompute: str | None = None
    precision: str | None = None
    offload_activations: bool = False
    offload_optimizer: str | None = None

    def __post_init__(self):
        for name in ("dp", "tp", "pp", "cp", "ep", "chunks", "num_microbatches"):
            _positive_int(name, getattr(self, name))
        if self.zero not in (0, 1, 2, 3) or isinstance(self.zero, bool):
            raise PlanError(f"ParallelPlan.zero is the ZeRO stage: 0 (DDP), 1, 2 or 3 (FSDP), got {self.zero!r}")
        if self.cp_layout not in ("zigzag", "contiguous"):
            raise PlanError(f"ParallelPlan.cp_layout={self.cp_layout!r}: use 'zigzag' (balanced causal work) or "
                            f"'contiguous'")
        if self.dp % self.ep:
            raise PlanError(f"ParallelPlan: ep={self.ep} must divide dp={self.dp} (expert parallelism spreads the "
                            f"experts over ep of the dp ranks)")
        if not callable(self.schedule) and self.schedule not in SCHEDULES:
            raise PlanError(f"ParallelPlan.schedule={self.schedule!r} is not a pipeline schedule; use one of "
                            f"{SCHEDULES}, or a generator fn(S, M) of per-rank op lists")
        if self.dp_kind not in DP_KINDS:
            raise PlanError(f"ParallelPlan.dp_kind={self.dp_kind!r}: use one of {DP_KINDS}")
        if isinstance(self.layers, list):                 # a list reads as naturally; the plan stays hashable
            object.__setattr__(self, "layers", tuple(self.layers))
        if self.layers is not None and not (isinstance(self.layers, tuple) and self.layers and all(
                isinstance(n, int) and not isinstance(n, bool) and n >= 1 for n in self.layers)):
            raise PlanError(f"ParallelPlan.layers={self.layers!r}: use None, or a tuple of positive block counts, one "
                            f"per pipeline stage (e.g. (3, 1))")
        if self.recompute is not None and self.recompute not in RECOMPUTE and not _is_recompute_plan(self.recompute):
            raise PlanError(f"ParallelPlan.recompute={self.recompute!r}: use None, one of {RECOMPUTE}, or a "
                            f"RecomputePlan (course_lib.memopt.recompute.make_plan)")
        if self.precision is not None and self.precision not in PRECISIONS:
            raise PlanError(f"ParallelPlan.precision={self.precision!r}: use None (the model's dtype) or one of "
                            f"{PRECISIONS}")
        if self.offload_optimizer is not None and self.offload_optimizer not in OPTIMIZER_TIERS:
            raise PlanError(f"ParallelPlan.offload_optimizer={self.offload_optimizer!r}: use None, 'host' "
                            f"(ZeRO-Offload) or 'disk' (ZeRO-Infinity's SSD tier)")
        for name in ("sequence_parallel", "offload_activations"):
            if not isinstance(getattr(self, name), bool):
                raise PlanError(f"ParallelPlan.{name} is True or False, got {getattr(self, name)!r}")
        r = self.fsdp_replicate
        if r is not None and r not in REPLICATE and not (isinstance(r, int) and not isinstance(r, bool) and r > 0):
            raise PlanError(f"ParallelPlan.fsdp_replicate={r!r}: use None, 'norms+biases', or a positive number of "
                            f"elements below which a parameter stays whole")

    @property
    def world_size(self) -> int:
        return self.pp * self.dp * self.cp * self.tp

    def replace(self, **changes) -> ParallelPlan:
        return replace(self, **changes)

    def as_dict(self) -> dict:
        return asdict(self)

    def describe(self) -> str:
        """A short name for tables: only what differs from the defaults."""
        default = ParallelPlan()
        parts = [f"{self.pp}×{self.dp}×{self.tp}"]
        parts += [f"{f.name}={getattr(self, f.name)}" for f in fields(self)
                  if f.name not in ("dp", "tp", "pp") and getattr(self, f.name) != getattr(default, f.name)]
        return " ".join(parts)

    # ------------------------------------------------------------------ can it work?
    def check(self, config, world_size: int, *, batch_size: int | None = None) -> ParallelPlan:
        """Raise PlanError (one line: the parameter and the fix) unless this plan can train `config` on
        `world_size` ranks with a global batch of `batch_size` sequences. Returns the plan, so calls chain."""
        from ..core.model import get_config
        from ..parallel.pipeline import plan_pipeline
        from ..parallel.tensor import check_tp
        cfg = get_config(config)
        if self.world_size != world_size:
            cp = f" × cp={self.cp}" if self.cp > 1 else ""
            raise PlanError(f"pp × dp × tp = {self.pp} × {self.dp} × {self.tp}{cp} = {self.world_size}, but there "
                            f"are {world_size} ranks; choose sizes whose product is {world_size}")
        if self.cp > 1:
            from ..parallel.context import check_cp
            try:
                check_cp(cfg.seq_len, self.cp, self.cp_layout)
            except ValueError as e:
                raise PlanError(str(e)) from None
        if self.ep > 1 and not cfg.n_expert:
            raise PlanError(f"ep={self.ep} spreads the experts of MoE layers, but the model is dense (n_expert=0); "
                            f"use a config with n_expert > 0, or ep=1")
        if self.ep > 1 and cfg.n_expert % self.ep:
            raise PlanError(f"n_expert={cfg.n_expert} does not split over ep={self.ep}; use an ep that divides it")
        if self.tp > 1:
            try:
                check_tp(cfg, self.tp, sequence_parallel=self.sequence_parallel)
            except ValueError as e:
                raise PlanError(str(e)) from None
        elif self.sequence_parallel:
            raise PlanError("sequence_parallel splits the sequence over the tp group, but tp=1; use tp ≥ 2 or "
                            "sequence_parallel=False")
        if self.pp > 1:
            try:
                plan_pipeline(cfg, self.pp, self.num_microbatches, self.schedule, chunks=self.chunks,
                              layers=self.layers)
            except ValueError as e:
                raise PlanError(str(e)) from None
        elif self.layers is not None:
            raise PlanError(f"layers={self.layers} splits the blocks over pipeline stages, but pp=1; use pp ≥ 2, or "
                            f"layers=None")
        elif self.chunks > 1:
            raise PlanError(f"chunks={self.chunks} interleaves virtual pipeline stages, but pp=1; use pp ≥ 2 with "
                            f"schedule='interleaved', or chunks=1")
        if batch_size is not None:
            n = self.dp * self.num_microbatches
            if not isinstance(batch_size, int) or batch_size < 1 or batch_size % n:
                raise PlanError(f"the global batch of {batch_size} sequences does not split into dp × num_microbatches "
                                f"= {self.dp} × {self.num_microbatches} equal micro-batches; use a multiple of {n}")
        self._check_combination(cfg)
        return self

    def _check_combination(self, cfg) -> None:
        """Combinations the course does not build, each with why (the techniques themselves run)."""
        if self.cp > 1 and self.sequence_parallel and (cfg.seq_len // self.cp) % self.tp:
            raise PlanError(f"sequence parallelism splits each cp rank's T/cp = {cfg.seq_len // self.cp} tokens over "
                            f"tp={self.tp}; use a seq_len that is a multiple of cp·tp (and of 2·cp for the zig-zag "
                            f"split), or sequence_parallel=False")
        if self.cp > 1 and self.pp > 1 and (self.recompute is not None or self.offload_activations
                                            or self.precision is not None):
            raise PlanError("context × pipeline parallelism composes with dp, ZeRO-1/2 and every schedule here; "
                            "recomputation, activation offload and mixed precision around ring attention inside a "
                            "stage are not built; drop them with cp > 1 and pp > 1")
        if self.cp > 1 and cfg.dropout > 0:
            raise PlanError("context parallelism needs dropout=0 (ring attention recombines blocks of the attention "
                            "map, whose dropout masks would have to match one process's); use dropout=0")
        if cfg.n_expert and self.sequence_parallel and self.recompute is not None:
            raise PlanError(f"recompute={self.recompute!r} with sequence parallelism and experts: the replay's "
                            f"collectives in MoE blocks are not in the formulas; use recompute=None, or "
                            f"sequence_parallel=False, with n_expert > 0")
        if self.ep > 1 and self.recompute is not None:
            raise PlanError(f"recompute={self.recompute!r} with ep={self.ep}: the replay would route the tokens again "
                            f"and repeat each MoE layer's all-to-all in backward, which is not built; use "
                            f"recompute=None with ep > 1")
        if cfg.n_expert and (self.zero == 3 or self.offload_optimizer is not None):
            raise PlanError(f"zero={self.zero}, offload_optimizer={self.offload_optimizer!r} with a mixture of "
                            f"experts: ZeRO-1/2 shard the replicated parameters' state over dp and the experts' over "
                            f"edp; FSDP and optimizer offload over those two groups are not built; use zero ≤ 2 and "
                            f"offload_optimizer=None with n_expert > 0")
        if self.zero == 3 and self.pp > 1:
            raise PlanError("zero=3 (FSDP) inside a pipeline would all-gather each stage's parameters for every one "
                            "of the M micro-batch forwards and backwards; use zero=1 or 2 with pp > 1 (as "
                            "Megatron-LM and DeepSpeed do), or pp=1")
        if self.fsdp_replicate is not None and self.zero != 3:
            raise PlanError(f"fsdp_replicate leaves parameters unsharded under FSDP, but zero={self.zero}; use "
                            f"zero=3, or fsdp_replicate=None")
        if self.pp > 1 and cfg.tie_weights:
            raise PlanError("a pipeline needs untied embeddings: with tie_weights=True the LM head on the last stage "
                            "shares its weight with the embedding on stage 0; use a config with tie_weights=False")
        if self.recompute is not None and self.zero == 3:
            raise PlanError(f"recompute={self.recompute!r} with zero=3: FSDP's gather hooks would fire again inside "
                            f"the replay of each block; use zero=1 or 2 with recomputation, or no recomputation with "
                            f"zero=3")
        if self.offload_activations and self.recompute is not None:
            raise PlanError(f"offload_activations with recompute={self.recompute!r}: recomputation replays the blocks "
                            f"in backward, when their saved tensors are already gone, so there is nothing left to "
                            f"offload; choose one of the two for the same blocks")
        if self.offload_activations and (self.zero == 3 or self.sequence_parallel):
            why = ("FSDP's gathered weights appear inside the blocks and would be offloaded needlessly"
                   if self.zero == 3 else "sequence parallelism keeps its own saved-tensor hooks inside the blocks, "
                                          "which take precedence, so part of each block would silently stay")
            raise PlanError(f"offload_activations with {'zero=3' if self.zero == 3 else 'sequence_parallel'}: {why}; "
                            f"use offload with zero ≤ 2 and without sequence parallelism")
        if self.offload_optimizer is not None:
            if self.zero in (0, 3) and self.dp > 1:
                raise PlanError(f"offload_optimizer moves each rank's optimizer shard to the {self.offload_optimizer} "
                                f"tier, which needs ZeRO-1 or 2 over dp={self.dp} (zero={self.zero}); use zero=1 or "
                                f"2, or offload_optimizer=None")
            if self.precision != "bf16":
                raise PlanError(f"offload_optimizer keeps bf16 parameters on the device and fp32 master weights and "
                                f"Adam state off it (ZeRO-Offload's recipe): use precision='bf16' with it, not "
                                f"{self.precision!r}")


__all__ = ["ParallelPlan", "PlanError", "SCHEDULES", "RECOMPUTE", "PRECISIONS", "OPTIMIZER_TIERS", "REPLICATE",
           "DP_KINDS"]
