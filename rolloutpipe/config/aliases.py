"""verl's and TRL's names of trainer keys, accepted under ``trainer.`` and read as ours.

docs/grpo.md ("Options, with their verl and TRL names") lists them.  :func:`trainer_aliases` rewrites
a mapping of trainer keys: ``load_config`` applies it per layer (so an alias in a later layer beats our
name in an earlier one, and an alias and our name disagreeing in one layer is an error naming the
layer), and ``TrainerConfig``'s validator applies it to ``TrainerConfig(...)``'s own arguments.
"""

from __future__ import annotations

import logging
from typing import Any

log = logging.getLogger("rolloutpipe.config")

# name -> (whose, our key)
TRAINER_ALIASES: dict[str, tuple[str, str]] = {
    "clip_ratio": ("verl", "clip_eps"),
    "clip_ratio_low": ("verl", "clip_low"),
    "clip_ratio_high": ("verl", "clip_high"),
    "kl_loss_coef": ("verl", "kl_coef"),
    "kl_loss_type": ("verl", "kl_estimator"),
    "entropy_coeff": ("verl", "entropy_coef"),
    "loss_agg_mode": ("verl", "loss_agg"),
    "epsilon": ("TRL", "clip_eps"),
    "epsilon_high": ("TRL", "clip_high"),
    "beta": ("TRL", "kl_coef"),
}
KL_ESTIMATORS = {"kl": "k1", "mse": "k2", "low_var_kl": "k3"}  # verl's kl_loss_type values
VERL_KL_LOSS_COEF = 0.001  # verl's kl_loss_coef default, taken by use_kl_loss=true alone


def trainer_aliases(data: dict[str, Any]) -> dict[str, Any]:
    """verl's and TRL's keys (and verl's ``use_kl_loss`` switch and ``kl_loss_type`` values) as ours;
    a ValueError names an alias that disagrees with our key."""
    data = dict(data)
    for alias, (whose, ours) in TRAINER_ALIASES.items():
        if alias not in data:
            continue
        value = data.pop(alias)
        if ours in data and data[ours] != value:
            raise ValueError(
                f"{alias} is {whose}'s name of {ours}: give one of them ({value!r} vs {data[ours]!r})"
            )
        log.info("trainer.%s is %s's name: read as trainer.%s", alias, whose, ours)
        data[ours] = value
    if "use_kl_loss" in data:  # verl: the KL term only with use_kl_loss, at kl_loss_coef
        use = data.pop("use_kl_loss")
        if not isinstance(use, bool):
            raise ValueError(f"use_kl_loss (verl) must be true or false, not {use!r}")
        if not use:
            data["kl_coef"] = 0.0
        elif not data.get("kl_coef"):
            data["kl_coef"] = VERL_KL_LOSS_COEF
    est = data.get("kl_estimator")
    if isinstance(est, str) and est in KL_ESTIMATORS:
        data["kl_estimator"] = KL_ESTIMATORS[est]
    return data
