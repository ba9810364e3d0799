"""The stages of one PPO step, each a unit of its own over the step's batch; the driver
(:mod:`trainer.driver`) orders them and owns the loop state:

`rollout -> reward -> log-probs (old, ref, values) -> advantage -> update (critic, actor) -> sync
-> metrics -> validate? -> checkpoint?`

- :mod:`~trainer.stages.rollout`: `n` responses per prompt from the rollout engines;
- :mod:`~trainer.stages.reward`: score each response, the score on its last token (and
  ReMax's greedy baseline);
- :mod:`~trainer.stages.logprobs`: old and reference log-probs, values, on every rank's rows;
- :mod:`~trainer.stages.advantage`: KL in the reward, then the advantage estimator;
- :mod:`~trainer.stages.update`: verl's mini-batches, the critic and actor updates;
- :mod:`~trainer.stages.sync`: the actor's weights to the rollout engines;
- :mod:`~trainer.stages.metrics`: the step's metrics and memory peaks;
- :mod:`~trainer.stages.validate`: validation metrics and generations;
- :mod:`~trainer.stages.checkpoint`: every group's shards and the loop state, saved or loaded.

A stage takes the batch and what it reads (the config, the tokenizer, a worker group, a
callable noting per-rank figures) as arguments, so each is tested alone
(`tests/trainer/test_stages.py`, worker groups faked at their process seam).
"""
