"""Operator tools: tail, status, dead letters, reports and timelines."""
