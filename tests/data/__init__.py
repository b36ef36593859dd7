"""Tests of :mod:`jaxpar.data`."""
