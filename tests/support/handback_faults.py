"""Run a pool worker that SIGKILLs itself mid-hand-back once armed: ``python
tests/support/handback_faults.py DIR MODULE ARGS…``.

The test arms the fault by creating ``DIR/armed``.  The first pool worker (of every process started
this way) that then hands a request back because its lease moved it to another run
(``RolloutWorker.leave`` set ``leaving``) claims ``DIR/fired`` (``O_EXCL``), writes what it was doing
into it, and dies: right after ``Broker.migrate`` put one continuation back when others of the same
hand-back are still to go (some handed back, some still pending on the dead worker), else just before
it (the preempted request still pending on the dead worker).  Until armed, and after it fired, the
worker runs normally.
"""

from __future__ import annotations

import os
import runpy
import signal
import sys
from pathlib import Path
from typing import Any


def _claim(d: Path, what: str) -> bool:
    if not (d / "armed").exists():
        return False
    try:
        fd = os.open(d / "fired", os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
        return False
    os.write(fd, what.encode())
    os.close(fd)
    return True


def main() -> None:
    d, module = Path(sys.argv[1]), sys.argv[2]
    from rolloutpipe.roles.rollout import RolloutWorker

    hand_back = RolloutWorker.hand_back

    # the rest of hand_back's arguments pass through as they are: a new one must not break the fault
    async def faulty_hand_back(self: RolloutWorker, entry: Any, req: Any, *rest: Any, **kw: Any) -> None:
        others = len(self.preempting - {entry.id})  # preempted by the same leave, not yet handed back
        if self.leaving and others == 0 and _claim(d, f"before migrate of {req.request_id} ({self.b.run})"):
            os.kill(os.getpid(), signal.SIGKILL)
        await hand_back(self, entry, req, *rest, **kw)
        what = f"after migrate of {req.request_id}, {others} more to hand back ({self.b.run})"
        if self.leaving and others > 0 and _claim(d, what):
            os.kill(os.getpid(), signal.SIGKILL)

    RolloutWorker.hand_back = faulty_hand_back  # type: ignore[method-assign]
    sys.argv = [module, *sys.argv[3:]]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
