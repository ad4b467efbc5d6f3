"""Reliability suite: hostile data and faults (a package so its conftest and helpers do not
shadow tests/conftest.py, which other test modules import as ``conftest``)."""
