"""The lab checks catch plausible wrong answers, each with the hint that names its real cause.

Every wrong answer is a small mutation of the solution notebook's own code (so the test follows the solution when it
changes, and fails loudly if a mutation no longer applies): the correct solution must pass the checks the wrong
answers are run against, and each mutation must fail with `CheckFailed` whose message contains the hint for that
mistake (not a generic one). Runs the nano preset on 2 ranks for a few steps (labs 03–04) and the checks of labs
05–11 directly, on their own small inputs; the slow checks (a real training run, a real S3 server) run in the
solution notebooks themselves.
"""
from __future__ import annotations

import re

import pytest

from course_lib.checks import CheckFailed, lab03, lab04, lab05, lab06, lab07, lab08, lab09, lab10, lab11

from ._nb import ROOT, read

pytestmark = [pytest.mark.integration, pytest.mark.notebooks]

N = 2
STEPS = 2


def _definitions(notebook: str, names: tuple) -> str:
    """The code cells of a solution notebook that define `names` (in order), imports first."""
    cells = [c.source for c in read(ROOT / "solutions" / notebook).cells if c.cell_type == "code"]
    imports = next(s for s in cells if s.startswith("import ") and "course_lib" in s)
    imports = "\n".join(line for line in imports.splitlines() if line.startswith(("import ", "from ")))
    defs = [s for s in cells if re.search(rf"^(def|class) ({'|'.join(names)})\b", s, re.M)]
    assert len(defs) == len(names), f"{notebook}: expected cells defining {names}"
    return "\n\n".join([imports, *defs])


def _load(source: str, mutations=()) -> dict:
    """Execute `source` after applying each (old, new) replacement, which must match exactly once."""
    for old, new in mutations:
        assert source.count(old) == 1, f"the mutation no longer applies to the solution: {old!r}"
        source = source.replace(old, new)
    namespace = {"__name__": "lab_solution", "WORLD_SIZE": N, "SEED": 0, "PRESET": "nano"}
    exec(compile(source, "<solution>", "exec"), namespace)
    return namespace


def _fails(fn, *hints):
    with pytest.raises(CheckFailed) as e:
        fn()
    message = str(e.value)
    assert message.startswith("✘ "), message
    for hint in hints:
        assert hint in message, f"expected {hint!r} in:\n{message}"
    return message


def _fails_with(fn, line: str, *hints):
    """`fn` fails with exactly `line` as its ✘ line (the cause) and a hint containing each of `hints`."""
    message = _fails(fn, *hints)
    assert message.splitlines()[0] == line, f"expected the line\n{line}\ngot\n{message}"
    return message


# ------------------------------------------------------------------------------------------------- lab 03
LAB03 = _definitions("lab03_ddp.ipynb", ("accumulation_step", "DataParallelTokenWeighted"))


def _accumulation(mutations=()):
    step = _load(LAB03, mutations)["accumulation_step"]
    return lambda: lab03.check_accumulation(step, world_size=N, steps=STEPS, accum_steps=2)


def _weighted(mutations=()):
    cls = _load(LAB03, mutations)["DataParallelTokenWeighted"]
    return lambda: lab03.check_token_weighted(cls, world_size=N, steps=STEPS)


def test_lab03_solution_passes_every_check():
    _accumulation()()
    _weighted()()


def test_lab03_all_micro_steps_under_no_sync_is_caught_by_where_the_sync_starts():
    _fails(_accumulation([("if micro < K - 1 else", "if True else")]),
           "accumulation_sync", "the last micro-step ran inside no_sync()", "last micro-step's backward must run "
                                                                           "outside it")


def test_lab03_unscaled_micro_step_losses_are_caught_as_a_factor_of_k():
    _fails(_accumulation([("(loss / K).backward()", "loss.backward()")]),
           "accumulation_gradient", "2.000× the reference's", "backpropagate loss / accum_steps")


def test_lab03_synchronizing_every_micro_step_is_caught_by_counting_synchronizations():
    _fails(_accumulation([("with model.no_sync() if micro < K - 1 else contextlib.nullcontext():",
                           "with contextlib.nullcontext():"),
                          ("            with phase(\"backward\"):\n                (loss / K).backward()",
                           "            with phase(\"backward\"):\n                (loss / K).backward()\n"
                           "            model.finish_gradient_synchronization()")]),
           "accumulation_sync", "gradient synchronizations in one optimizer step of 2 micro-steps",
           "inside `with model.no_sync():`")


def test_lab03_synchronizing_outside_no_sync_only_at_the_end_is_caught_with_the_wrappers_error():
    _fails(_accumulation([("with model.no_sync() if micro < K - 1 else contextlib.nullcontext():",
                           "with contextlib.nullcontext():")]),
           "accumulation_sync", "became ready twice", "micro-steps 0..K−2 inside `with model.no_sync():`")


def test_lab03_returning_the_sum_of_losses_is_caught_at_the_loss():
    _fails(_accumulation([("total += loss.item() / K", "total += loss.item()")]),
           "accumulation_training", "return the mean of the 2 unscaled micro-batch losses")


def test_lab03_averaging_after_weighting_is_caught_as_a_factor_of_1_over_n():
    _fails(_weighted([('bucket.buffer, "sum", algorithm', 'bucket.buffer, "avg", algorithm')]),
           "token_weighted_gradient", f"1/{N} of it", "SUMMED (op 'sum'), not averaged")


def test_lab03_local_token_count_as_the_total_is_caught_as_a_factor_of_n():
    _fails(_weighted([('self.comm.all_reduce(count, "sum", tag="tokens")', "pass")]),
           "token_weighted_gradient", "n the GLOBAL token count")


def test_lab03_no_weights_is_caught_as_plain_averaging():
    _fails(_weighted([("bucket.buffer.mul_(self.weight)", "bucket.buffer.div_(self.comm.world_size)")]),
           "token_weighted_gradient", "exactly plain averaging's")


def test_lab03_token_count_under_the_gradient_tag_is_caught_in_the_ledger():
    _fails(_weighted([('tag="tokens"', "tag=D.GRAD_TAG")]),
           "token_weighted_traffic", "the token count must travel under another tag")


# ------------------------------------------------------------------------------------------------- lab 04
LAB04 = _definitions("lab04_zero2.ipynb", ("adamw_step_", "Zero2"))
NO_BIAS_CORRECTION = [("(exp_avg_sq / (1 - beta2 ** step)).sqrt_()", "exp_avg_sq.sqrt()"),
                      ("value=-lr / (1 - beta1 ** step)", "value=-lr")]


def _zero2_checks(mutations=()):
    Z = _load(LAB04, mutations)["Zero2"]
    return (lambda: lab04.check_zero2_numerics(Z, N), lambda: lab04.check_zero2_memory(Z, N),
            lambda: lab04.check_zero2_traffic(Z, N))


def test_lab04_solution_passes_every_check():
    lab04.check_adamw(_load(LAB04)["adamw_step_"])
    for check in _zero2_checks():
        check()


def test_lab04_adamw_without_bias_correction_is_named_as_such_in_adamw_and_in_zero2():
    hint = "divide them by (1 − β₁ᵗ) and (1 − β₂ᵗ) first"
    _fails(lambda: lab04.check_adamw(_load(LAB04, NO_BIAS_CORRECTION)["adamw_step_"]), "✘ adamw", hint)
    message = _fails(_zero2_checks(NO_BIAS_CORRECTION)[0], "zero2_numerics", "gradient, m and v are right", hint)
    assert "reduce-scatter" not in message


def test_lab04_adamw_with_l2_instead_of_decoupled_decay_is_named():
    _fails(lambda: lab04.check_adamw(_load(LAB04, [("    param.mul_(1 - lr * weight_decay)\n", ""),
                                                   ("    exp_avg.mul_(beta1).add_(grad,",
                                                    "    grad = grad + weight_decay * param\n"
                                                    "    exp_avg.mul_(beta1).add_(grad,")])["adamw_step_"]),
           "✘ adamw", "that is Adam with L2 regularization")


def test_lab04_sum_instead_of_avg_is_caught_at_the_gradient_chunk():
    _fails(_zero2_checks([('p.grad, "avg", tag="lab_rs"', 'p.grad, "sum", tag="lab_rs"')])[0],
           "zero2_numerics", f"{N}.000× the reference", "reduce-scatter with op 'avg', not 'sum'")


def test_lab04_forgotten_all_gather_is_caught_at_the_full_parameter():
    _fails(_zero2_checks([('            all_gather_ring(self.comm, mine, p.numel(), tag="lab_ag", '
                           'out=p.detach().view(-1))\n', "")])[0],
           "zero2_numerics", "your own chunk is right", "all-gather every rank's chunk")


def test_lab04_a_view_instead_of_a_clone_keeps_whole_gradients_alive():
    numerics, memory, _ = _zero2_checks([("mine.clone() if self.grad_chunks[i]", "mine if self.grad_chunks[i]")])
    numerics()                                   # the values are right ...
    _fails(memory, "zero2_memory", "B of gradients", "keep .clone() of the chunk")   # ... the memory is not


def test_lab04_p_grad_left_set_is_caught_in_memory():
    _fails(_zero2_checks([("        p.grad = None\n        ### END SOLUTION", "        ### END SOLUTION")])[1],
           "zero2_memory", "p.grad is still set", "set p.grad = None in the hook")


# ------------------------------------------------------------------------------------------------- labs 05–11
def _lab(notebook: str, names: tuple) -> str:
    """A solution notebook's parameters cell, its imports cell (the one after the environment guard) and the cells
    that define `names`, in order."""
    cells = [c.source for c in read(ROOT / "solutions" / notebook).cells if c.cell_type == "code"]
    guard = next(i for i, src in enumerate(cells) if "check_environment()" in src)
    defs = [src for src in cells if re.search(rf"^(def|class) ({'|'.join(names)})\b", src, re.M)]
    assert defs, f"{notebook}: no cell defines any of {names}"
    return "\n\n".join([cells[0], cells[guard + 1], *dict.fromkeys(defs)])


def _wrong(table: dict):
    """Parametrize a test over a lab's table {id: (mutations, check, hints)}."""
    return pytest.mark.parametrize("mutations, check, hints", table.values(), ids=list(table))


LAB05 = _lab("lab05_schedules.ipynb", ("one_f_one_b",))
WARMUP = "warmup = min(S - 1 - r, M)"
STEADY = 'ops += [Op("F", r, warmup + i), Op("B", r, i)]'
LAB05_WRONG = {
    "warm_up_one_forward_too_many": ([(WARMUP, "warmup = min(S - r, M)")], lab05.check_in_flight,
                                     ("✘ in_flight", "rank 0 runs 2 forwards before its first backward",
                                      "one too many")),
    "warm_up_one_forward_too_few": ([(WARMUP, "warmup = max(0, min(S - 2 - r, M))")], lab05.check_bubble,
                                    ("✘ bubble", "expected (S−1)/(M+S−1)", "one too few")),
    "warm_up_not_clamped_to_m": ([(WARMUP, "warmup = S - 1 - r")], lab05.check_validates,
                                 ("✘ validates", "S−1−r > M here: clamp the warm-up to M")),
    "backward_before_forward_in_the_steady_state": (
        [(STEADY, 'ops += [Op("B", r, i), Op("F", r, warmup + i)]')], lab05.check_validates,
        ("✘ validates", "deadlock", "starts with a backward", "needs its forward first")),
    "backward_of_the_newest_micro_batch": ([(STEADY, 'ops += [Op("F", r, warmup + i), Op("B", r, warmup + i)]')],
                                           lab05.check_validates, ("✘ validates", "runs its backwards on micro-batches",
                                                                   "oldest first")),
    "cool_down_newest_first": ([("for mb in range(M - warmup, M)]", "for mb in reversed(range(M - warmup, M))]")],
                               lab05.check_bubble, ("✘ bubble", "runs its backwards on micro-batches [0, 2, 1]",
                                                    "oldest first")),
    "gpipe_order": ([(WARMUP, "warmup = M")], lab05.check_in_flight, ("✘ in_flight", "GPipe's order")),
    "every_op_on_stage_0": ([('ops = [Op("F", r, mb)', 'ops = [Op("F", 0, mb)')], lab05.check_validates,
                            ("✘ validates", "rank r runs stage r only")),
}


def test_lab05_solution_passes_the_schedule_checks():
    fn = _load(LAB05)["one_f_one_b"]
    for check in (lab05.check_validates, lab05.check_in_flight, lab05.check_bubble):
        check(fn)


@_wrong(LAB05_WRONG)
def test_lab05_wrong_schedule_fails_with_the_rule_it_breaks(mutations, check, hints):
    fn = _load(LAB05, mutations)["one_f_one_b"]
    _fails(lambda: check(fn), *hints)


LAB06 = _lab("lab06_row_parallel.ipynb", ("f", "RowParallelLinear"))
F_BACKWARD = ('        out = grad.contiguous().clone()\n        all_reduce_ring(ctx.comm, out, tag="f")\n'
              '        return out, None')
ROW_OUT = "return g.apply(partial, self.comm) + self.bias"
LAB06_WRONG = {
    "f_backward_without_all_reduce": ([(F_BACKWARD, "        return grad, None")], "f_and_g",
                                      ("✘ f_and_g", "f's gradient is off", "f's backward all-reduces")),
    "g_backward_all_reduces_too": (
        [("        out = x.contiguous().clone()\n        all_reduce_ring(comm, out, tag=\"g\")\n        return out",
          "        ctx.comm = comm\n        out = x.contiguous().clone()\n"
          "        all_reduce_ring(comm, out, tag=\"g\")\n"
          "        return out"),
         ("    def backward(ctx, grad):\n        ### BEGIN SOLUTION\n        return grad, None",
          "    def backward(ctx, grad):\n        ### BEGIN SOLUTION\n        out = grad.contiguous().clone()\n"
          "        all_reduce_ring(ctx.comm, out, tag=\"g\")\n        return out, None")],
        "f_and_g", ("✘ f_and_g", "g's gradient is off", "passes the incoming gradient through unchanged")),
    "g_forward_without_all_reduce": (
        [("        out = x.contiguous().clone()\n        all_reduce_ring(comm, out, tag=\"g\")\n        return out",
          "        return x.view_as(x)")], "f_and_g", ("✘ f_and_g", "g's forward output is off", "sum over the ranks")),
    "weight_split_on_the_output_dimension": ([("chunk(t, dim=1)[r]", "chunk(t, dim=0)[r]")], "row",
                                             ("✘ row_parallel", "weight has shape (24, 192), expected (48, 96)",
                                              "chunk(t, dim=1)")),
    "bias_added_before_g": ([(ROW_OUT, "return g.apply(partial + self.bias, self.comm)")], "row",
                            ("✘ row_parallel", "plus (t − 1) × the bias", "g summed t copies of it")),
    "no_g_in_the_row_layer": ([(ROW_OUT, "return partial + self.bias")], "row",
                              ("✘ row_parallel", "nothing was sent in forward", "only this rank's partial sum")),
    "bias_split_over_the_ranks": ([(ROW_OUT, "return g.apply(partial + self.bias / self.comm.world_size, self.comm)")],
                                  "row", ("✘ row_parallel", "bias gradient differs", "add the whole bias after g")),
}


def _lab06_check(which, ns):
    if which == "f_and_g":
        return lambda: lab06.check_f_and_g(ns["f"], ns["g"])
    return lambda: lab06.check_row_parallel(ns["RowParallelLinear"])


def test_lab06_solution_passes_f_g_and_the_row_layer():
    ns = _load(LAB06)
    _lab06_check("f_and_g", ns)()
    _lab06_check("row", ns)()


@_wrong(LAB06_WRONG)
def test_lab06_wrong_operator_or_layer_fails_with_its_cause(mutations, check, hints):
    _fails(_lab06_check(check, _load(LAB06, mutations)), *hints)


LAB07 = _lab("lab07_prefetch_hooks.ipynb", ("PrefetchOffload",))
PREFETCH = "            self.fetch(nxt, background=True)\n"
LAB07_WRONG = {
    "the_head_never_starts_the_top_layers_prefetch": ([("else max(self.by_layer, default=-1)", "else -1")],
                                                      lab07.check_peak,
                                                      ("✘ peak", "layer(s) [3] were fetched only when",
                                                       "start the top layer's prefetch")),
    "no_prefetch_at_all": ([(PREFETCH, "            pass\n")], lab07.check_peak,
                           ("✘ peak", "[3, 2, 1, 0]", "no layer was prefetched")),
    "prefetch_two_layers_ahead": (
        [(PREFETCH, PREFETCH + "            if nxt >= 1 and nxt - 1 not in self.inflight"
                               " and self.by_layer.get(nxt - 1):\n"
                               "                self.fetch(nxt - 1, background=True)\n")],
        lab07.check_peak, ("✘ peak", "prefetch one layer ahead only")),
    "a_prefetch_not_waited_for": ([("                fut.result()\n", "                pass\n")], lab07.check_gradients,
                                  ("✘ gradients", "before their copies to the device had finished",
                                   "wait for its prefetch")),
    "parameters_offloaded_too": ([(" or storage._cdata in self.keep", "")], lab07.check_bytes,
                                 ("✘ bytes", "went to the host", "self.keep (the parameters and buffers)")),
    "every_save_remembered_not_only_new_stashes": (
        [("        if new:\n            self.by_layer[self.layer].append(stash)",
          "        self.by_layer[self.layer].append(stash)")], lab07.check_bytes,
        ("✘ bytes", "came back", "remember a stash only when swap.stash says it is new")),
    "prefetched_and_fetched_again": ([("                fut.result()\n",
                                       "                fut.result()\n"
                                       "                self.fetch(layer, background=False)\n")],
                                     lab07.check_bytes, ("✘ bytes", "came back more than once", "never both")),
    "unpack_returns_the_note": ([("return self.swap.view(x) if isinstance(x, _Packed) else x", "return x")],
                                lab07.check_gradients, ("✘ gradients", "swap.view(note) for a note")),
}


def test_lab07_solution_passes_every_check():
    cls = _load(LAB07)["PrefetchOffload"]
    for check in (lab07.check_gradients, lab07.check_peak, lab07.check_bytes):
        check(cls)


@_wrong(LAB07_WRONG)
def test_lab07_wrong_hooks_fail_with_their_cause(mutations, check, hints):
    cls = _load(LAB07, mutations)["PrefetchOffload"]
    _fails(lambda: check(cls), *hints)


LAB08 = _lab("lab08_recompute_policies.ipynb", ("norms_and_gelu", "held_bytes", "greedy_segments"))
POLICY = "return func in (aten.native_layer_norm.default, aten.gelu.default)"
ERROR = 'raise ValueError(f"block {i} alone keeps {s:,} bytes, more than the budget of {budget:,}")'
LAB08_WRONG = {
    "policy_compares_op_names_as_strings": ([(POLICY, 'return str(func) in ("aten.layer_norm", "aten.gelu")')],
                                            "policy", ("✘ norms_and_gelu", "never answered True", "not a string")),
    "policy_forgets_gelu": ([(POLICY, "return func == aten.native_layer_norm.default")], "policy",
                            ("✘ norms_and_gelu", "GELU's output is still kept")),
    "policy_recomputes_a_matmul": ([(POLICY, POLICY[:-1] + ", aten.addmm.default)")], "policy",
                                   ("✘ norms_and_gelu", "FLOPs; recomputing", "every matrix multiply")),
    "held_bytes_keeps_the_norm_statistics": ([(" + 2 * 2 * 4 * tokens", "")], "held",
                                             ("✘ held_bytes", "off by +", "mean and 1/std in")),
    "held_bytes_gelu_output_as_d_model": ([("(2 + cfg.mlp_ratio) * cfg.d_model", "(2 + 1) * cfg.d_model")], "held",
                                          ("✘ held_bytes", "mlp_ratio·d_model = 256 values per token")),
    "greedy_closes_at_the_budget": ([("if total + s > budget:", "if total + s >= budget:")], "greedy",
                                    ("✘ greedy_segments", "(>, not ≥)")),
    "greedy_ends_exclusive_by_one": ([("segments.append((start, i))", "segments.append((start, i - 1))")], "greedy",
                                     ("✘ greedy_segments", "end is the first block NOT in the segment")),
    "greedy_forgets_the_last_segment": ([("return segments + [(start, len(saved))]", "return segments")], "greedy",
                                        ("✘ greedy_segments", "close the segment still open")),
    "error_names_the_size_not_the_block": ([(ERROR, 'raise ValueError(f"a block of {s} bytes is over {budget}")')],
                                           "greedy", ("✘ greedy_segments", "should name block 3", "not its size")),
    "error_counts_blocks_from_1": ([(ERROR, 'raise ValueError(f"block {i + 1} is over the budget")')], "greedy",
                                   ("✘ greedy_segments", "count blocks from 0", "not 4")),
}


def _lab08_check(which, ns):
    return {"policy": lambda: lab08.check_norms_and_gelu(ns["norms_and_gelu"]),
            "held": lambda: lab08.check_held_bytes(ns["held_bytes"], ns["norms_and_gelu"]),
            "greedy": lambda: lab08.check_greedy_segments(ns["greedy_segments"])}[which]


def test_lab08_solution_passes_the_policy_and_greedy_checks():
    ns = _load(LAB08)
    _lab08_check("policy", ns)()
    _lab08_check("greedy", ns)()


@_wrong(LAB08_WRONG)
def test_lab08_wrong_policy_bytes_or_segments_fail_with_their_cause(mutations, check, hints):
    _fails(_lab08_check(check, _load(LAB08, mutations)), *hints)


LAB09 = _lab("lab09_loss_scaler_int8.ipynb", ("LossScaler", "quantize"))
LAB09_WRONG = {
    "counter_not_reset_on_overflow": ([("            self.growth_tracker = 0\n            return",
                                        "            return")],
                                      "scaler", ("✘ scaler_trajectory", "reset it to 0 on every overflow")),
    "grows_one_step_late": ([("if self.growth_tracker == self.growth_interval:",
                              "if self.growth_tracker > self.growth_interval:")], "scaler",
                            ("✘ scaler_trajectory", "grow when it reaches growth_interval (==)")),
    "counter_not_reset_after_growing": ([("                self.scale = grown\n            self.growth_tracker = 0",
                                          "                self.scale = grown")], "scaler",
                                        ("✘ scaler_trajectory", "reset it to 0 after growing")),
    "grows_into_inf": ([("            if math.isfinite(grown):\n                self.scale = grown",
                         "            self.scale = grown")], "scaler",
                       ("✘ scaler_trajectory", "your scale is inf", "grow only if the result is finite")),
    "backs_off_the_wrong_way": ([("_f32(self.scale * self.backoff_factor)", "_f32(self.scale / self.backoff_factor)")],
                                "scaler", ("✘ scaler_trajectory", "(overflow)", "multiply it by backoff_factor")),
    "scale_0_for_an_all_zero_block": ([("torch.where(absmax > 0, absmax, torch.ones_like(absmax)) / 127",
                                        "absmax / 127")], "quantizer",
                                      ("✘ int8_quantizer", "an all-zero block got the scale [0.0]", "0/0 = NaN")),
    "codes_truncated": ([("codes = torch.round(flat / step)", "codes = (flat / step)")], "quantizer",
                        ("✘ int8_quantizer", "do not truncate")),
    "divides_by_128": ([("torch.ones_like(absmax)) / 127", "torch.ones_like(absmax)) / 128")], "quantizer",
                       ("✘ int8_quantizer", "you divide by 128")),
    "max_without_abs": ([("absmax = torch.stack([b.abs().max() for b in blocks])",
                          "absmax = torch.stack([b.max() for b in blocks])")], "quantizer",
                        ("✘ int8_quantizer", "largest MAGNITUDE")),
    "last_block_padded": ([("    step = scales.repeat_interleave(block_size)[:flat.numel()]",
                            "    flat = torch.cat([flat, flat.new_zeros(-flat.numel() % block_size)])\n"
                            "    step = scales.repeat_interleave(block_size)[:flat.numel()]")], "quantizer",
                          ("✘ int8_quantizer", "got 6144", "nothing for padding")),
    "nan_not_refused": ([("        raise ValueError(\"cannot quantize NaN/inf: it would become its block's absmax\")\n",
                          "        pass\n")], "bound", ("✘ int8_error_bound", "did not raise ValueError")),
    "bound_a_whole_step": ([("/ 254\n", "/ 127\n")], "bound", ("✘ int8_error_bound", "at most HALF a step")),
}


def _lab09_check(which, ns):
    return {"scaler": lambda: lab09.check_scaler_trajectory(ns["LossScaler"]),
            "quantizer": lambda: lab09.check_int8_quantizer(ns["quantize"], ns["dequantize"]),
            "bound": lambda: lab09.check_int8_error_bound(ns["quantize"], ns["dequantize"], ns["error_bound"])}[which]


def test_lab09_solution_passes_the_scaler_and_int8_checks():
    ns = _load(LAB09)
    for which in ("scaler", "quantizer", "bound"):
        _lab09_check(which, ns)()


@_wrong(LAB09_WRONG)
def test_lab09_wrong_scaler_or_quantizer_fails_with_its_cause(mutations, check, hints):
    _fails(_lab09_check(check, _load(LAB09, mutations)), *hints)


LAB10 = _lab("lab10_atomic_checkpoint.ipynb", ("atomic_write", "save_checkpoint", "load_latest"))
FSYNC_DIR = ("    fd = os.open(path.parent, os.O_RDONLY)\n    try:\n        os.fsync(fd)\n"
             "    finally:\n        os.close(fd)\n")
LAB10_WRONG = {
    "temporary_file_outside_the_directory": (
        [('tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")', "tmp = Path(tempfile.mkdtemp()) / path.name")],
        "write", ("✘ atomic_write", "outside", "create the temporary file in path's own directory")),
    "no_fsync_of_the_file": ([("            os.fsync(f.fileno())\n", "")], "write",
                             ("✘ atomic_write", "no fsync of the file before the rename")),
    "no_fsync_of_the_directory": ([(FSYNC_DIR + "    ### END SOLUTION", "    ### END SOLUTION")], "write",
                                  ("✘ atomic_write", "no fsync of the directory after the rename")),
    "temporary_left_after_a_failure": ([("        tmp.unlink(missing_ok=True)\n        raise", "        raise")],
                                       "write", ("✘ atomic_write", "remove the temporary file when anything fails")),
    "failure_swallowed": ([("        tmp.unlink(missing_ok=True)\n        raise",
                            "        tmp.unlink(missing_ok=True)\n        return")], "write",
                          ("✘ atomic_write", "let the OSError propagate")),
    "written_in_place_without_staging": ([('    staging = root / f".tmp-{final.name}"', "    staging = final"),
                                          ("        os.replace(staging, final)\n", "")], "save",
                                         ("✘ save_checkpoint", "not published by one rename")),
    "staging_left_after_a_failure": ([("        shutil.rmtree(staging, ignore_errors=True)\n        raise",
                                       "        raise")],
                                     "save", ("✘ save_checkpoint", "remove the staging directory")),
    "root_not_fsynced": ([("    fd = os.open(root, os.O_RDONLY)\n    try:\n        os.fsync(fd)\n    finally:\n"
                           "        os.close(fd)\n    return final", "    return final")], "save",
                         ("✘ save_checkpoint", "no fsync of the root directory")),
    "staging_directories_loaded": ([('re.fullmatch(r"step_\\d{8}", p.name)', 're.search(r"step_\\d{8}", p.name)')],
                                   "load", ("✘ load_latest", ".tmp-step_00000009", "re.fullmatch, not search")),
    "bad_manifest_json_not_caught": ([('        except ValueError:\n            skipped.append((name, "MANIFEST.json '
                                       'is not valid JSON"))\n            continue\n', "")], "load",
                                     ("✘ load_latest", "raised JSONDecodeError", "catch it, skip the checkpoint")),
    "missing_manifest_not_caught": ([('        except FileNotFoundError:\n            skipped.append((name, "no '
                                      'MANIFEST.json: the save never finished"))\n            continue\n', "")], "load",
                                    ("✘ load_latest", "raised FileNotFoundError", "catch FileNotFoundError")),
    "size_not_compared": ([('            if len(data) != want["bytes"]:', "            if False:")], "load",
                          ("✘ load_latest", "should say 'truncated'", "compare each file's size")),
    "oldest_first": ([("                   reverse=True)", "                   reverse=False)")], "load",
                     ("✘ load_latest", "returned step 1", "newest first")),
}


def _lab10_check(which, ns):
    return {"write": lambda: lab10.check_atomic_write(ns["atomic_write"]),
            "save": lambda: lab10.check_save(ns["save_checkpoint"]),
            "load": lambda: lab10.check_fallback(ns["load_latest"])}[which]


def test_lab10_solution_passes_every_check():
    ns = _load(LAB10)
    for which in ("write", "save", "load"):
        _lab10_check(which, ns)()


@_wrong(LAB10_WRONG)
def test_lab10_wrong_write_save_or_load_fails_with_its_cause(mutations, check, hints):
    _fails(_lab10_check(check, _load(LAB10, mutations)), *hints)


LAB11 = _lab("lab11_hash_ring.ipynb", ("HashRing",))
LOOKUP = ("        i = bisect.bisect_left(self._hashes, K.stable_hash(key))\n"
          "        return self._owners[i % len(self._owners)]          # past the last point: wrap to the first")
LAB11_WRONG = {
    "pythons_per_process_hash": ([("K.stable_hash(node, v)", "hash((node, v))"), ("K.stable_hash(key)", "hash(key)")],
                                 ("✘ ring_moves", "in another process", "Python's hash() of a string differs")),
    "no_wrap_around": ([("self._owners[i % len(self._owners)]", "self._owners[i]")],
                       ("✘ ring_moves", "raised IndexError", "wrap", "FIRST point")),
    "one_point_per_node": ([("for v in range(vnodes)", "for v in range(1)")],
                           ("✘ ring_moves", "of the keys (fair share", "give every node `vnodes` points")),
    "hash_mod_n": ([(LOOKUP, "        return self.nodes[K.stable_hash(key) % len(self.nodes)]")],
                   ("✘ ring_moves", "keys changed owner", "not a hash mod the number of nodes")),
    "points_not_sorted": ([("points = sorted((K.stable_hash(node, v), node)",
                            "points = list((K.stable_hash(node, v), node)")],
                          ("✘ ring_moves", "points are not sorted")),
    "points_not_depending_on_the_node": ([("K.stable_hash(node, v)", "K.stable_hash(v)")],
                                         ("✘ ring_moves", "every key went to node 0", "depend on its node")),
    "owners_as_strings": ([("self._owners = [n for _, n in points]", "self._owners = [str(n) for _, n in points]")],
                          ("✘ ring_moves", "are not nodes of range(3)", "as given")),
}


def test_lab11_solution_passes_the_ring_check():
    lab11.check_ring_moves(_load(LAB11)["HashRing"])


@pytest.mark.parametrize("mutations, hints", LAB11_WRONG.values(), ids=list(LAB11_WRONG))
def test_lab11_wrong_ring_fails_with_its_cause(mutations, hints):
    cls = _load(LAB11, mutations)["HashRing"]
    _fails(lambda: lab11.check_ring_moves(cls), *hints)
