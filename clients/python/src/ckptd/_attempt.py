"""Attempts: the id every save carries, shared by the ranks of one run of a job.

A step commits from the saves of exactly one attempt, so a step never mixes
ranks of two runs (a crashed run's late rank and its restart's). All ranks
of a run must use the same attempt, and the next run (after a crash or a
resize) another one: launchers set ``CKPTD_ATTEMPT``.
"""

from __future__ import annotations

import os
import re
import secrets

from ._errors import InvalidArgumentError

ENV = "CKPTD_ATTEMPT"
# The daemon's syntax: [a-z0-9._-]{1,64}, not starting with ".".
_SYNTAX = re.compile(r"(?!\.)[a-z0-9._-]{1,64}")
HOWTO = (
    "set CKPTD_ATTEMPT to the same id on every rank in the launcher "
    "(e.g. CKPTD_ATTEMPT=$SLURM_JOB_ID-$SLURM_RESTART_COUNT), or pass Client(attempt=...)"
)


def check(attempt: object, where: str) -> str:
    """Return attempt if the daemon would accept it; where names its origin.

    Raises:
        TypeError: attempt is not a str.
        InvalidArgumentError: it does not match [a-z0-9._-]{1,64} or starts
            with ".".
    """
    if not isinstance(attempt, str):
        raise TypeError(f"{where} must be a str, not {type(attempt).__name__}")
    if not _SYNTAX.fullmatch(attempt):
        raise InvalidArgumentError(
            f"{where} {attempt!r} is not a valid attempt: use 1 to 64 of a-z, 0-9, '.', '_' "
            "and '-', not starting with '.' (e.g. $SLURM_JOB_ID-$SLURM_RESTART_COUNT)"
        )
    return attempt


def new() -> str:
    """A fresh random attempt (16 hex digits)."""
    return secrets.token_hex(8)


def resolve(attempt: str | None) -> tuple[str, bool]:
    """The client's attempt: the argument, else $CKPTD_ATTEMPT, else a random one.

    Returns:
        The attempt, and whether it was given (argument or environment)
        rather than made up here. An empty $CKPTD_ATTEMPT counts as unset.
    """
    if attempt is not None:
        return check(attempt, "attempt"), True
    if env := os.environ.get(ENV):
        return check(env, f"${ENV}"), True
    return new(), False
