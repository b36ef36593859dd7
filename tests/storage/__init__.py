"""Tests of :mod:`jaxpar.storage`."""
