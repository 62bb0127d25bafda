"""The worker side of the ``vllm`` engine: in-place loading of a published policy version.

vLLM mixes :class:`WeightSyncExtension` into its worker class (engine arg
``worker_extension_cls``), so the method below runs inside every vLLM worker process, where the
model lives, when the engine calls ``AsyncLLM.collective_rpc(LOAD_METHOD, args=(pv_json,))``.

The worker verifies the sha256 manifest again before touching the model (the rollout process has
already verified it; this catches a file changed in between), so a refused version leaves the
engine's weights as they were.  The weights are then loaded through vLLM's own in-place reload
(``Worker.reload_weights``, the layerwise reload: it re-runs each layer's
``process_weights_after_loading``).  A plain ``model.load_weights`` is not enough on the CPU
backend, which repacks every linear weight for its GEMM kernels at load time and leaves the
original parameter empty; it is used only where ``reload_weights`` does not exist (older vLLM).

Only this module is imported in the vLLM worker; it imports nothing from vLLM itself.
"""

from __future__ import annotations

import logging
from typing import Any

from rolloutpipe.errors import WeightsVerificationError

log = logging.getLogger("rolloutpipe.rollout")

LOAD_METHOD = "rolloutpipe_load_policy_version"  # unique: must not clash with a vLLM worker attribute
EXTENSION = f"{__name__}.WeightSyncExtension"
REFUSED = "vLLM worker refused the weights"  # marks a verification failure in the RPC's error text


class WeightSyncExtension:
    """Methods vLLM adds to its worker class; ``self`` is the vLLM worker."""

    model_runner: Any

    def rolloutpipe_load_policy_version(self, pv_json: str) -> int:
        """Verify then load the ``PolicyVersion`` (JSON) in place; returns its version."""
        from rolloutpipe.broker.events import PolicyVersion
        from rolloutpipe.model.weights import load_verified_state

        pv = PolicyVersion.model_validate_json(pv_json)
        try:
            state = load_verified_state(pv)
        except WeightsVerificationError as e:
            raise WeightsVerificationError(f"{REFUSED}: {e}") from e
        reload = getattr(self, "reload_weights", None)
        if reload is not None:
            reload(weights_iterator=iter(state.items()), is_checkpoint_format=True)
        else:
            self.model_runner.model.load_weights(weights=iter(state.items()))
        log.info("vLLM worker loaded policy version %d (%d tensors)", pv.policy_version, len(state))
        return pv.policy_version
