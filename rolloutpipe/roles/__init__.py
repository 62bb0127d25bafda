"""The role processes: controller, rollout worker, aggregator, pool scheduler, trainer."""
