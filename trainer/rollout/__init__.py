"""Rollout engines behind one interface (:mod:`trainer.rollout.base`): HF `generate`
(:mod:`trainer.rollout.hf`, CPU and tests) and vLLM (:mod:`trainer.rollout.vllm`, GPUs)."""
