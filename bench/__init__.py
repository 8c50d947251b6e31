"""Microbenchmarks and end-to-end benchmarks; each compares against a baseline measured in the same run.

Every benchmark module has ``add_arguments(parser)`` and ``run(args) -> dict``; ``wse bench NAME``
prints its table and writes its JSON. The table below is all the command line reads until a
benchmark is chosen, so ``wse --help`` imports none of them (the first line of each help is the
module's docstring; a test holds them equal).
"""
BENCHMARKS = {
    "optim": ("bench.optim", "Fused AdamW against plain numpy and against memory-copy bandwidth, in the same run."),
    "nn": ("bench.nn", "Forward + backward of one GPT-2 block and of a small GPT-2: fused kernels against "
                       "unfused numpy (and PyTorch, if installed)."),
    "input": ("bench.input", "The input pipeline: preprocessing against the tokenizer alone and a plain h5py "
                             "write; loading against raw h5py."),
    "stream": ("bench.stream", "Weight streaming end to end: step time and its breakdown for 1, 2 and 4 CS-2s, "
                               "against the single-process step."),
    "sparse": ("bench.sparse", "Sparse kernels on transformer-sized weights: GFLOP/s against scipy.sparse and "
                               "dense numpy, spmv against copy bandwidth."),
    "faults": ("bench.faults", "Fault campaign: kill and stop every role at random moments, kill the launcher; "
                               "count what is named right."),
    "scaling": ("bench.scaling", "Scaling of the emulated cluster, from the simulated-time model: samples/s and "
                                 "speed-up for 1 to 192 CS-2s."),
    "appliance": ("bench.appliance", "The appliance against `wse fit`: the same jobs queued on a CS-2 pool, and run "
                                     "one after another directly."),
    "fabric": ("bench.fabric", "The PE-mesh simulator's speed, and BiCGSTAB cycles per iteration next to the "
                               "SC20 figures."),
}
