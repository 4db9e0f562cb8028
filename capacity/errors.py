"""The one exception type the planner raises for bad input."""

from __future__ import annotations


class CapacityError(ValueError):
    """A user-facing problem with an input: a config file, a table row, a layout or an option.

    The message is a single line that names the offending field or row and, where there is a
    closed set, the allowed values; the CLI prints it as-is and exits non-zero.
    """
