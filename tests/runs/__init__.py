"""Tests of :mod:`jaxpar.runs`."""
