"""RL maths shared by the aggregator and the trainer: advantages and losses."""
