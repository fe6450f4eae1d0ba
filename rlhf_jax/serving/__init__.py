"""The rollout served over HTTP: an OpenAI-compatible endpoint for agents."""
