"""The Rollout seam and its implementations (`base.py` explains the seam)."""
