"""The training step: :class:`~jaxpar.training.trainer.Trainer` (a model, an optimizer and a
plan; no configs), the default objective, the optimizer and schedule, trainable filters and
batches made ahead.
"""
