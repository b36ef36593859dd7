"""How a run is laid out: meshes, logical-axis rules, the :class:`~jaxpar.sharding.plan.Plan`
and the policies it names (precision, remat), logical names by path, pinned module outputs,
and placing a model's variables by the rules.

The lowest layer of jaxpar (above :mod:`jaxpar.errors` and :mod:`jaxpar.storage`):
everything else reads a Plan.
"""
