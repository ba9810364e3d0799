"""Asynchronous RL (verl's `one_step_off_policy` and `fully_async_policy` recipes): the bounded
queue of finished samples between the rollout pool and the trainer, each tagged with the weight
version that sampled it (:mod:`trainer.async_rl.queue`). The keys are
:mod:`trainer.config.async_training`."""
