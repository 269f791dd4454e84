"""The epifuse benchmark (not part of the installed package; see README.md, Performance).

    python -m benchmarks                  every section of BENCHMARKS.md in one run
                                          (scripts/bench.sh --markdown BENCHMARKS.md)
    python -m benchmarks.real_heads       its real-heads section alone
    python -m benchmarks.distributed      its data-parallel section alone (2 GPUs or more)
    python -m benchmarks.report           the report of a bench.json again, measuring nothing

Modules: ``timing`` (how: CUDA events, interleaved rounds, L2 flush, host time), ``cases``
(what: the KernelBench problems' shapes, dtype columns, the plan, running one configuration),
``real_heads`` and ``distributed`` (their sections), ``report`` (tables, legend, environment,
charts). Only epifuse's public API is used (``epifuse``, ``epifuse.cli``, ``epifuse.problems``,
``epifuse.precision``, ``epifuse.distributed``, ``torch.ops.epifuse``). One-off measurements
behind the kernels' design live in experiments/, not here.
"""
