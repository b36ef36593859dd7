"""What XLA did: collectives, memory and FLOPs read from compiled programs
(:mod:`~jaxpar.analysis.hlo`), ``jaxpar inspect``'s report (:mod:`~jaxpar.analysis.inspection`)
and its tables (:mod:`~jaxpar.analysis.report`).
"""
