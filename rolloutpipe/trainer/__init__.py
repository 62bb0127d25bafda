"""GRPO loss, the version fence, the torch backend and weight publishing."""
