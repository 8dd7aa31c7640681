"""Exit codes, the one-line error report, and the leaves of an exception group.

Every command ends in one of the codes of :data:`EXIT_MEANINGS` (``run`` also in its child's,
:data:`EXIT_RUN`); a failure is one line on stderr, never a traceback. :data:`EXIT_CODES_HELP`
is the table as ``--help`` shows it.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager

from sidecar import log

EXIT_OK, EXIT_FAIL, EXIT_CONFIG, EXIT_PENDING = 0, 1, 2, 75
#: ``prune``: some eligible namespaces could not be pruned; ``verify``: some namespace is damaged.
EXIT_PARTIAL, EXIT_DAMAGED = 3, 4

#: The exit codes and what each means (``status``: 1 when not in sync).
EXIT_MEANINGS: dict[int, str] = {
    EXIT_OK: "ok",
    EXIT_FAIL: "runtime failure",
    EXIT_CONFIG: "bad configuration",
    EXIT_PARTIAL: "some namespaces failed (prune)",
    EXIT_DAMAGED: "damage found (verify)",
    EXIT_PENDING: "stopped with changes pending",
}
#: ``run``'s codes beyond those: its child's, or fenced.
EXIT_RUN = f"the child's own code, 128+N for signal N, {EXIT_PENDING} when fenced by a newer sidecar"
EXIT_CODES_HELP = "exit codes: " + ", ".join(f"{c} {m}" for c, m in EXIT_MEANINGS.items()) + f"; run: {EXIT_RUN}"


class StoreConfigError(Exception):
    """The store URL or its credentials cannot be used (found when the store is built): exit 2."""


def fail(msg: str, code: int = EXIT_FAIL) -> int:
    """Write ``msg`` (secrets redacted) as the one error line on stderr; return ``code``."""
    print(f"checkpoint-sidecar: error: {log.redact(msg)}", file=sys.stderr)
    return code


def leaves(eg: BaseException) -> Iterator[BaseException]:
    """The exceptions inside a (nested) exception group, in order; a plain exception is its own leaf."""
    if isinstance(eg, BaseExceptionGroup):
        for e in eg.exceptions:
            yield from leaves(e)
    else:
        yield eg


@contextmanager
def first_of(kind: type[BaseException]) -> Iterator[None]:
    """Around a task group whose tasks may fail with ``kind``: an exception group holding one is
    raised as its first such exception alone (one reason, one line), anything else as it was."""
    try:
        yield
    except BaseExceptionGroup as eg:
        for exc in leaves(eg):
            if isinstance(exc, kind):
                raise exc from None
        raise
