"""Streams, codec, consumer groups and the embedded Redis."""
