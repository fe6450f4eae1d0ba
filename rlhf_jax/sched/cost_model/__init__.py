"""The cost model: roofline device and model profiles, the costs of an RL
step's pieces, the setting they are priced in, an async batch's seconds.
The simulator (`rlhf_jax.sim`) and the async job's split use it alike."""
