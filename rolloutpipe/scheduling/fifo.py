"""FIFO: every request of the step released at once, in dataset order (slime's and verl's loop).

Engines admit in that order; an engine may queue its share of the step (``rollout.engine_queue``),
as a router that dispatches every request on arrival does.  With ``trainer.schedule: barrier``
this is ``sync``; with ``pipelined`` it is ``cgp``.
"""

from __future__ import annotations

from rolloutpipe.scheduling.base import BasePolicy


class FifoPolicy(BasePolicy):
    """G samples per prompt, all released at once: ``BasePolicy`` as it is."""


class LateFifoPolicy(FifoPolicy):
    """FIFO release, late assignment: engines admit only into free slots, with no per-engine share.

    The control that separates load balancing from admission order: it releases like ``fifo`` but
    binds a request to an engine only when that engine has a free slot, as FGD does, without FGD's
    frontier order or window.
    """

    engine_queue = False
