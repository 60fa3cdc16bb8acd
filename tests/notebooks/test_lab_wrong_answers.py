"""The lab checks catch plausible wrong answers, each with the hint that names its real cause.

Every wrong answer is a small mutation of the solution notebook's own code (so the test follows the solution when it
changes, and fails loudly if a mutation no longer applies): the correct solution must pass every check, and each
mutation must fail with `CheckFailed` whose message contains the hint for that mistake. Runs the nano preset on
2 ranks for a few steps.
"""
from __future__ import annotations

import re

import pytest

from course_lib.checks import CheckFailed, lab03, lab04

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
