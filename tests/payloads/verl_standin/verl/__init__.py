"""Stand-in for verl (tests only): see `trainer/main_ppo.py`."""
