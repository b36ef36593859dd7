"""Tests of :mod:`jaxpar.parallel`."""
