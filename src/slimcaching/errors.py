"""The one exception type a user's mistake turns into.

The CLI prints ``str(error)`` on one line and exits non-zero; library callers can catch it.
"""

from __future__ import annotations


class ScenarioError(ValueError):
    """Invalid input: the message names the field and the offending value."""

    def __init__(self, field: str, message: str, value: object = None, *, show_value: bool = True):
        self.field = field
        self.value = value
        text = f"{field}: {message}"
        if show_value and value is not None:
            shown = repr(value)
            if len(shown) > 80:
                shown = shown[:77] + "..."
            text += f" (got {shown})"
        super().__init__(text)

    def renamed(self, field: str) -> ScenarioError:
        """The same error naming ``field`` instead (how the CLI says ``--trace`` for ``trace``)."""
        new = type(self).__new__(type(self))
        new.__dict__.update(self.__dict__)
        new.args = (field + str(self)[len(self.field):],)
        new.field = field
        return new
