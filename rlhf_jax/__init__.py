"""rlhf_jax: JAX-native RL post-training for LLMs (GRPO family, RLHF with PPO)."""

__version__ = "0.1.0"
