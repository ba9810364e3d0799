"""PPO mathematics: pure tensor functions, each in the module that owns it (`advantages`,
`policy_losses`, `aggregation`, `kl`, `masked`, `lr_schedule`, `rollout_corr`; `core_algos` names
them all under verl's module name) and the registries that name them (`registry`, torch-free, so
configuration checks can read what each estimator needs)."""
