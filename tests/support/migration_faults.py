"""Run a role with a SIGKILL planted in long-tail migration: ``python tests/support/migration_faults.py MODE
MARKER MODULE ARGS…``.

The kill fires once across every process started this way: the first to create ``MARKER``
(``O_EXCL``) dies; the others run normally.  Modes:

* ``source-before``: the worker that preempted a request dies before ``Broker.migrate`` runs (the
  partial response is lost; the request is still pending on the dead worker);
* ``source-after``: it dies right after ``Broker.migrate`` put the continuation on ``requests``;
* ``target``: the worker that admitted a continuation dies while generating it.
"""

from __future__ import annotations

import asyncio
import os
import runpy
import signal
import sys
from typing import Any


def _fire(marker: str) -> bool:
    try:
        os.close(os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return False
    return True


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def main() -> None:
    mode, marker, module = sys.argv[1], sys.argv[2], sys.argv[3]
    from rolloutpipe.broker.streams import Broker
    from rolloutpipe.roles.rollout import RolloutWorker

    migrate = Broker.migrate
    handle = RolloutWorker.handle

    async def faulty_migrate(self: Broker, request_entry: str, cont: Any) -> str:
        if mode == "source-before" and _fire(marker):
            _die()
        out = await migrate(self, request_entry, cont)
        if mode == "source-after" and out and _fire(marker):
            _die()
        return out

    async def faulty_handle(self: RolloutWorker, entry: Any, req: Any) -> None:
        if mode == "target" and req.segment > 0 and _fire(marker):
            asyncio.get_running_loop().call_later(0.05, _die)  # mid-generation of the continuation
        await handle(self, entry, req)

    Broker.migrate = faulty_migrate  # type: ignore[method-assign]
    RolloutWorker.handle = faulty_handle  # type: ignore[method-assign]
    sys.argv = [module, *sys.argv[4:]]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
