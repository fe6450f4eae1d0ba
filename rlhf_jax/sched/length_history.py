"""Per-prompt response-length history (RLHFless prompt ranking).

Training prompts come back every epoch and a prompt's response length is
autocorrelated across epochs, so an exponentially weighted moving average of
the lengths seen so far predicts the next one without a learned model. The
EWMA weight is [U] in the paper; it is a knob (`alpha`, weight of the newest
observation).
"""

import statistics


class LengthHistory:
  """EWMA of each prompt's mean response length."""

  def __init__(self, alpha: float = 0.5):
    if not 0.0 < alpha <= 1.0:
      raise ValueError(f"alpha must be in (0, 1], got {alpha}")
    self.alpha = alpha
    self._ewma = {}

  def update(self, prompt_id: int, lengths: list[float]):
    """Folds one epoch's response lengths of a prompt into its history."""
    observed = statistics.fmean(lengths)
    old = self._ewma.get(prompt_id)
    self._ewma[prompt_id] = (observed if old is None else
                             self.alpha * observed + (1 - self.alpha) * old)

  def predict(self, prompt_id: int, default: float) -> float:
    """Predicted length; `default` for a prompt never seen (first epoch)."""
    return self._ewma.get(prompt_id, default)

  def known(self, prompt_id: int) -> bool:
    return prompt_id in self._ewma

  def mean(self, default: float) -> float:
    """Mean prediction over every prompt seen; `default` when none is."""
    return statistics.fmean(self._ewma.values()) if self._ewma else default

  def state_dict(self) -> dict:
    """Checkpointable state (resume-first: the history survives restarts)."""
    return {"alpha": self.alpha, "ewma": dict(self._ewma)}

  def load_state_dict(self, state: dict) -> None:
    """Restores `state_dict()` output (JSON turns the keys into strings)."""
    self.alpha = float(state["alpha"])
    self._ewma = {int(k): float(v) for k, v in state["ewma"].items()}

  @classmethod
  def from_state_dict(cls, state: dict) -> "LengthHistory":
    history = cls(state["alpha"])
    history.load_state_dict(state)
    return history
