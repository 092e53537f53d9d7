"""Tensor parallelism (``--tensor-parallel-size N``): one process per device, each holding
its share of every layer's heads; see ``docs/tensor-parallel.md``."""
