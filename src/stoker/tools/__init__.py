"""Tools beside the data path: `bench` (with `bench_gpu`, `baseline` and `charts`), `doctor`, `demo`,
the synthetic data generator `synth`, and the training step they share (`train`).

They import the core (`stoker.loader`, `stoker.profiling`, ...); nothing in the core imports them.
A training loop never needs this package.
"""
