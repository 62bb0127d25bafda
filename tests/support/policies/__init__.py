"""Policies written outside the package, as a user would, loaded by dotted path."""
