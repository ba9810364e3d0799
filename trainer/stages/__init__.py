"""The stages of one PPO step, each a unit of its own over the step's batch; the driver
(:mod:`trainer.driver`) orders them and owns the loop state:

`rollout -> reward -> log-probs (old, ref, values) -> advantage -> update (critic, actor) -> sync
-> metrics -> validate? -> checkpoint?`

- :mod:`~trainer.stages.reward`: score each response, the score on its last token;
- :mod:`~trainer.stages.advantage`: KL in the reward, then the advantage estimator.

A stage takes the batch and what it reads (the config section, the tokenizer, a worker group)
as arguments, so each is tested alone (`tests/trainer/test_stages.py`).
"""
