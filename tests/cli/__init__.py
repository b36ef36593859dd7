"""Tests of the jaxpar command line (a package, so that its test modules may share names
with those of other test folders: test_convert, test_plan, test_calibrate, test_inspection)."""
