"""hpcrl: Slurm-native batch framework for RL training of language models.

The launcher stays light: importing :mod:`hpcrl` never imports torch, ray or vllm.
"""

__version__ = "0.1.0"
