"""areal: launch and diagnose RL post-training jobs for large language models."""

__version__ = "0.1.0"
