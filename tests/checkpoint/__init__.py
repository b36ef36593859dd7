"""Tests of :mod:`jaxpar.checkpoint`."""
