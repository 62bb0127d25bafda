"""Moved to ``rolloutpipe/bench/memory_flatness.py``: run ``python -m rolloutpipe.bench.memory_flatness``.

This path still works (it runs the module), for the commands written before the move.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from rolloutpipe.bench.memory_flatness import main

if __name__ == "__main__":
    raise SystemExit(main())
