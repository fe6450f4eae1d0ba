"""Errors in what a person gave the job: config, data, checkpoints, rewards.

`rlhf_jax.main` prints a `UserError` as one line (no traceback unless
`--verbose`) and exits with status 2; anything else is a bug and keeps its
traceback. Each class also derives from the builtin a caller would catch
(`ValueError`, `FileNotFoundError`, ...).
"""


class UserError(Exception):
  """Bad input from the person running the job."""


class ConfigError(UserError, ValueError):
  """A config value or combination that cannot run; names the key path."""


class DataError(UserError, ValueError):
  """A dataset that is empty, malformed or does not fit the config."""


class MissingFieldError(UserError, KeyError):
  """A data record without a field the config asks for."""

  def __str__(self):  # KeyError quotes its message; this is a sentence.
    return str(self.args[0]) if self.args else ""


class MissingInputError(UserError, FileNotFoundError):
  """A file or directory the job needs does not exist (yet)."""


class CheckpointError(UserError, ValueError):
  """A checkpoint that belongs to another job or model shape."""


class NonFiniteError(UserError, FloatingPointError):
  """A loss went NaN or inf; the last checkpoint is intact."""
