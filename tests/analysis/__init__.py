"""Tests of :mod:`jaxpar.analysis`."""
