"""PPO mathematics as small pure tensor functions, under verl's module name.

Each piece lives in the module that owns it, and this module re-exports each one's `__all__` where the trainer
and verl's readers look for them (verl's `verl.trainer.ppo.core_algos`):

- :mod:`trainer.algos.masked`: masked statistics, a sequence score on its last token;
- :mod:`trainer.algos.advantages`: the advantage estimators (`algorithm.adv_estimator`);
- :mod:`trainer.algos.policy_losses`: the policy losses (`actor.policy_loss.loss_mode`);
- :mod:`trainer.algos.aggregation`: `loss_agg_mode`, the value loss, the entropy;
- :mod:`trainer.algos.kl`: the KL estimators, the penalty in the reward, its controllers;
- :mod:`trainer.algos.lr_schedule`: the learning-rate schedule;
- :mod:`trainer.algos.pf_ppo`: PF-PPO's resampling of the rows (`algorithm.use_pf_ppo`).

Importing this module registers every estimator and policy loss
(:mod:`trainer.algos.registry`). Shapes: ``(batch, response_length)`` for token-level tensors,
with ``response_mask`` holding 1.0 on the response tokens that count (up to and including the
first EOS) and 0.0 elsewhere. Names follow verl (``clip_ratio_low``, ``cliprange_value``,
``kl_penalty``, ``loss_agg_mode``). No function reads a configuration object: every knob is an
explicit argument.
"""

from __future__ import annotations

from trainer.algos.advantages import *  # noqa: F403 (the names of its `__all__`)
from trainer.algos.aggregation import *  # noqa: F403 (the names of its `__all__`)
from trainer.algos.kl import *  # noqa: F403 (the names of its `__all__`)
from trainer.algos.lr_schedule import *  # noqa: F403 (the names of its `__all__`)
from trainer.algos.masked import *  # noqa: F403 (the names of its `__all__`)
from trainer.algos.pf_ppo import *  # noqa: F403 (the names of its `__all__`)
from trainer.algos.policy_losses import *  # noqa: F403 (the names of its `__all__`)
