"""A training run end to end: the loop (:mod:`~jaxpar.runs.loop`), its log and monitors,
interrupts, multi-process start-up (:mod:`~jaxpar.runs.distributed`) and sampling from a
finished run (:mod:`~jaxpar.runs.generate`).
"""
