"""User errors in the command-line tools: one ``error:`` line naming the bad value, exit 2.

The demo, the dry run, the cost model, the benchmarks and the GRPO example check their
arguments and the layout before any rank starts; an error a spawned rank raises on a bad
layout or model ends the same way (read from the rank's traceback). Anything else keeps its
traceback: it is a bug, not a bad input.
"""

from __future__ import annotations

import functools
import re
import sys
from collections.abc import Callable

from megatron_refit.errors import SpawnError

USER_ERRORS = ("ValueError", "PlanError", "LocalSplitError")
"""Errors a rank raises on a bad layout or model (the message names the bad value)."""


def plain(doc: str) -> str:
    """A module docstring as ``--help`` text: reST roles and literals as plain words
    (```x``` -> ``x``; ``:mod:`a.b``` -> ``a.b``; ``:func:`~a.b.c``` -> ``c``)."""
    doc = re.sub(r":[a-z]+:`~?([^`]+)`", lambda m: m.group(1).rsplit(".", 1)[-1] if m.group(0).find("~") > 0
                 else m.group(1), doc)
    return doc.replace("``", "")


def user_error(message: str) -> int:
    print(f"error: {message}", file=sys.stderr)
    return 2


def reports_user_errors(main: Callable[..., int]) -> Callable[..., int]:
    """``main(argv)``: a ``ValueError`` raised before the ranks start, or a user error raised
    in a rank, becomes one ``error:`` line and exit code 2."""

    @functools.wraps(main)
    def wrapped(*args, **kwargs) -> int:
        try:
            return main(*args, **kwargs)
        except SpawnError as exc:
            inner = exc.innermost
            if inner is None or inner[0] not in USER_ERRORS:
                raise
            return user_error(inner[1])
        except ValueError as exc:
            return user_error(str(exc))
    return wrapped
