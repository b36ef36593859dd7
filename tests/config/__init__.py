"""Tests of :mod:`jaxpar.config`."""
