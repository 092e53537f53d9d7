"""Attention-side ops: K/V write and paged decode attention (Triton on CUDA, torch on CPU).

Callers use ``pagedserve.kernels.ops``; it picks the implementation per device.
"""
