"""Tests of :mod:`jaxpar.sharding`."""
