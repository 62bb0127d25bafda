"""Collected only by scripts/test-compose.sh (RP_SUITE=docker): the images and the containers take
minutes, so the core suite leaves this folder out instead of running it twice."""

import os

collect_ignore_glob = [] if os.environ.get("RP_SUITE") == "docker" else ["test_*.py"]
