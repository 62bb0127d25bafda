"""Moved to ``rolloutpipe/bench/admission_oracle.py``: run ``python -m rolloutpipe.bench.admission_oracle``.

This path still works (it runs the module), for the commands written before the move.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from rolloutpipe.bench.admission_oracle import main

if __name__ == "__main__":
    main()
