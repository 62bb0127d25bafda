"""RolloutPipe: pipelined, strictly on-policy RLVR over Redis streams."""

__version__ = "0.1.0"
