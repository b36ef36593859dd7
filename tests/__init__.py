"""Tests of jaxpar, one folder per package."""
