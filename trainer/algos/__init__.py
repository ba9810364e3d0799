"""PPO mathematics: pure tensor functions (`core_algos`) and the registries that name them
(`registry`, torch-free, so configuration checks can read what each estimator needs)."""
