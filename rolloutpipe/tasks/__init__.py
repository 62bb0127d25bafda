"""Verifiable tasks: shipped datasets, users' data formats, rewards and verifiers."""
