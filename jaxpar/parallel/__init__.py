"""The parallelisms a model calls into, one module each: ZeRO shardings, pipeline stages
(and a user's model divided into them, :mod:`~jaxpar.parallel.staged`), context-parallel
attention, attention kernels and the vocabulary-parallel loss.
"""
