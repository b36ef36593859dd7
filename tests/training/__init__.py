"""Tests of :mod:`jaxpar.training`."""
