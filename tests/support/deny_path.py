"""Run a module with one directory made unreadable to it:
``python tests/support/deny_path.py DIR MODULE ARGS…``.

An audit hook (PEP 578) refuses every ``open``, ``os.listdir`` and ``os.scandir`` of a path under
``DIR`` with ``PermissionError``, so a role started this way behaves as if it were on a host
without that directory.  (Native code that opens files itself, such as safetensors' Rust reader,
is not seen by the hook: tests check the paths such code is given separately.)
"""

from __future__ import annotations

import os
import runpy
import sys
from typing import Any


def main() -> None:
    denied = os.path.realpath(sys.argv[1])
    module = sys.argv[2]

    def hook(event: str, args: tuple[Any, ...]) -> None:
        if (
            event in ("open", "os.listdir", "os.scandir")
            and args
            and isinstance(args[0], str | bytes | os.PathLike)
        ):
            path = os.fsdecode(os.fspath(args[0]))
            real = os.path.realpath(path)
            if real == denied or real.startswith(denied + os.sep):
                raise PermissionError(f"{path}: not on this host (tests/support/deny_path.py)")

    sys.addaudithook(hook)
    sys.argv = [module, *sys.argv[3:]]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
