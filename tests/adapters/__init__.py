"""Tests of :mod:`jaxpar.adapters`."""
