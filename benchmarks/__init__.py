"""The epifuse benchmark (not part of the installed package; see docs/performance.md).

    python -m benchmarks                  every section of BENCHMARKS.md in one run
                                          (scripts/bench.sh --markdown BENCHMARKS.md)
    python -m benchmarks.real_heads       its real-heads section alone
    python -m benchmarks.loop             its training-loop section alone (batch sweep, optimizer
                                          step, eager / fused / torch.compile incl. reduce-overhead)
    python -m benchmarks.distributed      its data-parallel section alone (2 GPUs or more)
    python -m benchmarks.report           the report of a bench.json again, measuring nothing

Modules: ``timing`` (how: CUDA events, interleaved rounds, L2 flush, host time), ``cases``
(what: the KernelBench problems' shapes, dtype columns, the plan, running one configuration),
``real_heads``, ``loop`` and ``distributed`` (their sections), ``report`` (tables, legend, environment,
charts). Only epifuse's public API is used (``epifuse``, ``epifuse.cli``, ``epifuse.problems``,
``epifuse.precision``, ``epifuse.distributed``, ``torch.ops.epifuse``). One-off measurements
behind the kernels' design live in experiments/, not here.
"""
