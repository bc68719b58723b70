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

    def followed_by(self, context: str) -> ScenarioError:
        """The same error with ``; context`` at the end of its line (what else the reader should know)."""
        new = type(self).__new__(type(self))
        new.__dict__.update(self.__dict__)
        new.args = (f"{self}; {context}",)
        return new


def did_you_mean(name: object, known) -> str:
    """`` (did you mean 'x'?)`` for the known name nearest to ``name``, or nothing."""
    import difflib  # start-up: difflib only for a misspelt name

    close = difflib.get_close_matches(str(name).strip().lower(), [str(k) for k in known], n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


CONTROL_CHARACTERS = "control characters are not allowed in names"


def has_control_characters(value: object) -> bool:
    """True for text with C0/C1 control characters: they would reach a terminal raw (ANSI and OSC
    escape sequences), so names may not have them."""
    return isinstance(value, str) and any(ord(c) < 0x20 or 0x7F <= ord(c) < 0xA0 for c in value)


def printable(value: str, field: str) -> str:
    """``value`` if :func:`has_control_characters` is false; else a :class:`ScenarioError` naming ``field``."""
    if has_control_characters(value):
        raise ScenarioError(field, CONTROL_CHARACTERS, value)
    return value


# optional packages -> the extra that brings them (pyproject.toml); torch is installed first, alone:
# its plain requirement would make pip fetch a multi-GB CUDA build
EXTRAS = {"torch": "hf", "transformers": "hf", "safetensors": "hf", "tokenizers": "hf", "zmq": "runtime",
          "msgpack": "runtime", "ray": "ray", "starlette": "serve", "uvicorn": "serve", "prometheus_client": "serve"}


def missing_extra_line(module: str) -> str | None:
    """The one line that says which install brings ``module`` (None: not one of our extras)."""
    root = module.split(".")[0]
    extra = EXTRAS.get(root)
    if extra is None:
        return None
    extras = {"hf": "hf,runtime", "runtime": "hf,runtime", "serve": "hf,runtime,serve"}.get(extra, extra)
    torch = "pip install torch==2.13.0 && " if extra in ("hf", "runtime", "serve") else ""
    return (f"this command needs {root}, which is not installed (the '{extra}' extra): "
            f"{torch}pip install -e '.[{extras}]'   (or: make .venv/.full)")


class SolverBug(RuntimeError):
    """An algorithm returned something it must not (e.g. over capacity): a bug, not bad input."""
