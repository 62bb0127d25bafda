"""The registry of ``RP_…`` environment variables that are not config overrides, and who reads each.

The config's own namespace is ``RP_<KEY>`` for a top-level key and ``RP_<SECTION>__<KEY>…`` below
(``load_config``'s environment layer, ``rolloutpipe/config/load.py``).  The names here belong to the
tools, to docker-compose's interpolation and to the test suite: they never reach the config, and are
not warned about.  docs/operations.md lists them; a test checks that every ``RP_…`` name the code,
compose and the docs use is either a config key or registered here.
"""

from __future__ import annotations

TOOL_VARIABLES: dict[str, str] = {
    "RP_REDIS_URL": "tail, status and dlq: the Redis URL when --redis-url is not given",
    "RP_REDIS_SERVER": "the redis-server binary the embedded Redis starts",
    "RP_WORKER_ID": "the rollout worker's consumer name when --worker-id is not given",
    # docker-compose.yml's interpolation variables (the shell or .env; compose reads them)
    "RP_STEPS": "compose, cpu profile: controller.steps",
    "RP_REDIS_HOST": "compose: the host of the Redis the roles use",
    "RP_MODELS_DIR": "compose: the host directory mounted at /models",
    "RP_DATA_DIR": "compose: the host directory mounted at /data",
    "RP_REDIS_APPENDFSYNC": "compose: the Redis service's appendfsync",
    "RP_WEIGHTS_SERVE": "compose: trainer.weights_serve of every service (empty: off)",
    "RP_WEIGHTS_URL": "compose: rollout.weights_url of every service (empty: the runs volume)",
    "RP_REDIS_CONTROLLER_PASSWORD": "compose: the controller's Redis password",
    "RP_REDIS_ROLLOUT_PASSWORD": "compose: the rollout workers' Redis password",
    "RP_REDIS_AGGREGATOR_PASSWORD": "compose: the aggregator's Redis password",
    "RP_REDIS_TRAINER_PASSWORD": "compose: the trainer's Redis password",
    "RP_REDIS_OBSERVER_PASSWORD": "compose: the observer's (healthchecks) Redis password",
    "RP_REDIS_POOL_PASSWORD": "compose: the pool scheduler's Redis password",
    "RP_RUN_A": "compose, pool profile: the first run's name (default run-a)",
    "RP_RUN_B": "compose, pool profile: the second run's name (default run-b)",
    "RP_POOL": "compose, pool profile: the rollout pool's name (default shared)",
    "RP_POOL_POLICY": "compose, pool profile: the pool scheduler's --policy (default lookahead)",
    "RP_REDIS_IMAGE": "compose: the Redis service's image (default redis:7.2)",
    "RP_BASE_IMAGE": "compose: the CPU image's base image (build arg BASE_IMAGE)",
    "RP_TORCH_SOURCE": "compose: where the CPU image's torch wheel comes from (build arg TORCH_SOURCE)",
    # the test suite's knobs
    "RP_TEST_MODEL_CACHE": "tests: where the tiny model is built once",
    "RP_CHAOS_SEED": "tests: replay one chaos schedule",
    "RP_CHAOS_SEEDS": "tests: the seeds the pooled chaos test runs (a,b,c)",
    "RP_FUZZ_EXAMPLES": "tests: examples per fuzzed decoder and handler (default 10,000)",
    "RP_SUITE": "tests: the suite being run (deepspeed, vllm: its engine must import; docker)",
}
