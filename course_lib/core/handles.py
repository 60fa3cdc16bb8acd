"""Where a technique leaves its handle on the model it was applied to: one place, read one way.

Every `apply_<technique>(model, mesh, …)` returns a model — the same object changed in place, or a wrapper around
it — and records with `attach` what a caller may need of the technique afterwards: the pipeline's executor, the
recomputation plan, the activation offloader, the precision recipe, what reduces the gradients over dp, the
optimizer. `handle_of(model, technique)` finds it through every wrapper applied after it (a wrapper keeps the model
it wraps as `.module`), and `handles(model)` lists them all in the order they were applied.

    model = apply_pipeline(model, mesh, num_microbatches=4)
    model = apply_dp(model, mesh)
    handle_of(model, "pipeline")            # the stage's executor, seen through the DDP wrapper
"""
from __future__ import annotations

_ATTR = "_course_handles"      # a plain attribute: nn.Module would register a module-valued handle as a submodule


def attach(model, technique: str, handle) -> None:
    """Record `handle` as what `technique` left on `model` (applying it again replaces it)."""
    book = model.__dict__.setdefault(_ATTR, {})
    book.pop(technique, None)                      # re-applied: it moves to the end, where it now stands
    book[technique] = handle


def inherit(new, old) -> None:
    """`new`, built from `old` without wrapping it (a pipeline stage cut from a model, a tensor-parallel model made
    from a GPT), takes over the handles of the techniques applied to `old` before it."""
    for technique, handle in handles(old).items():
        if technique not in new.__dict__.get(_ATTR, {}):
            attach(new, technique, handle)


def detach(model, technique: str) -> None:
    """Forget `technique`'s handle on `model` (the technique was undone)."""
    model.__dict__.get(_ATTR, {}).pop(technique, None)


def _chain(model) -> list:
    """`model` and the models it wraps, outermost first."""
    out = []
    while model is not None and all(model is not m for m in out):
        out.append(model)
        inner = model.__dict__.get("_modules", {}).get("module") if hasattr(model, "__dict__") else None
        model = inner if inner is not None else model.__dict__.get("module") if hasattr(model, "__dict__") else None
    return out


def handles(model) -> dict:
    """{technique: handle} of every technique applied to `model` or to a model it wraps, in the order applied."""
    out = {}
    for m in reversed(_chain(model)):
        out.update(m.__dict__.get(_ATTR, {}))
    return out


def handle_of(model, technique: str, default=None):
    """What `technique` left on `model` (or on a model it wraps); `default` if it was not applied."""
    return handles(model).get(technique, default)


__all__ = ["attach", "detach", "handle_of", "handles", "inherit"]
