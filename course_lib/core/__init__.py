"""The foundation every other layer builds on: the toy model, its data, and the few shared helpers.

    model      the toy GPT (presets ~44 K – ~20 M parameters; dense or mixture-of-experts): its parameter, FLOP and
               activation counts
    moe        the mixture-of-experts layer (router, top-k, capacity, auxiliary loss) the GPT uses when n_expert > 0
    data       the shipped real-text corpus, the byte tokenizer, rank-sharded deterministic batches
    files      the one atomic write (write, fsync, rename, fsync the directory)
    costmodel  the alpha-beta link model with sourced presets and a calibration helper ("modeled")
    plots      per-rank timelines, memory by category, traffic bars
    handles    where each `apply_<technique>` leaves its handle on the model: `attach`, `handle_of(model, technique)`
"""
