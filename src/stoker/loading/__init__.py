"""The loading wing: what the worker threads (or worker processes) do on the CPU. Render samples into
the rows of a ring of slots, hand finished slots out in order. Nothing here imports `stoker.device`
or makes a CUDA call: the device wing builds on this one, never the other way round."""
