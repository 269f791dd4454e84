"""The epifuse benchmark (not part of the installed package; see README.md, Performance).

    python -m benchmarks                  ModelNew vs eager and torch.compile (BENCHMARKS.md)
    python -m benchmarks.gemm_precision   the fp32 GEMM alone: speed and error per precision
    python -m benchmarks.distributed      data-parallel training steps vs nn.SyncBatchNorm

Modules: ``timing`` (how: CUDA events, interleaved rounds, L2 flush, host time), ``cases``
(what: problems, shapes, dtype columns, the plan, running one configuration), ``report``
(tables, legend, environment, charts).
"""
