"""Tests of jaxpar.planner, one file per module (a package, so that file names such as
test_layout.py may recur in other test folders)."""
