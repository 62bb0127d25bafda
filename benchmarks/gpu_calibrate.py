"""Moved to ``rolloutpipe/bench/gpu_calibrate.py``: run ``python -m rolloutpipe.bench.gpu_calibrate``.

This path still works (it runs the module), for the commands written before the move.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from rolloutpipe.bench.gpu_calibrate import main

if __name__ == "__main__":
    raise SystemExit(main())
