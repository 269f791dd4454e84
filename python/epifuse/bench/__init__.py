"""``python -m epifuse.bench``: the epifuse benchmark.

ModelNew (fused epifuse forward) against the reference ``Model`` in PyTorch
eager and under ``torch.compile``, for KernelBench problems 84 and 39, in
train and eval forwards and training steps (forward + backward), fp32 (IEEE,
3xTF32 and TF32), bf16 and fp16; plus our GEMM alone, the host time of a
small-batch forward, and our row softmax against torch.softmax and the
device's copy bandwidth.

Modules, one job each:
  configs   what runs: problems and shapes, dtype/precision settings, the plan
  models    seeded models, primed running statistics, identical copies
  timing    median timing (CUDA events, or perf_counter on CPU) with rotated inputs
  accuracy  errors against a float64 reference
  runner    one model configuration: accuracy, timings, GEMM alone
  training  the train-step mode: step inputs (x requiring grad, upstream g), the step, dX/dW checks
  hosttime  host (CPU) time per forward while the GPU is kept busy
  kernels   softmax sweep and device-to-device copy bandwidth
  persist   bench.json checkpoints after every configuration; --resume reads them
  progress  progress bar (tqdm if installed, else a plain fallback)
  env       environment facts (GPU, versions, date, command line)
  report    text table, Markdown and JSON;  chart: the PNG (matplotlib)
"""

# The optional packages the benchmark uses (pyproject.toml's `bench` extra), for the messages
# printed when one is missing.
EXTRA_HINT = "install the bench extra: pip install 'epifuse[bench]' (matplotlib, tqdm)"
