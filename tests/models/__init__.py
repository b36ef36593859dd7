"""Tests of :mod:`jaxpar.models`."""
