"""specdec's tests: one folder per wing of the package, shared fixtures in conftest.py.

A package, so that test modules are imported by their full names (`tests.core.test_cache`) and
two wings may hold test files of the same name.
"""
