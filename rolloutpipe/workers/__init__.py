"""Controller, rollout worker, aggregator, engines and allocation policies."""
