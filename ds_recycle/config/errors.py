"""The one error type of configuration parsing."""
from __future__ import annotations


class ConfigError(ValueError):
    """A config value is missing, misspelt, of the wrong type or impossible.

    The message always names the key (as a dotted path), the value found and the fix.
    """

    def __init__(self, key: str, problem: str, fix: str) -> None:
        self.key, self.problem, self.fix = key, problem, fix
        super().__init__(f"config key '{key}': {problem}. Fix: {fix}")
