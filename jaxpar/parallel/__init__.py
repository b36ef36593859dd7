"""The parallelisms a model calls into, one module each: ZeRO shardings, pipeline stages,
context-parallel attention, attention kernels and the vocabulary-parallel loss.
"""
