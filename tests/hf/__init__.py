"""Tests of :mod:`jaxpar.hf`."""
