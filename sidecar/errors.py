"""Exit codes, the one-line error report, and the leaves of an exception group.

Every command ends in one of these codes; a failure is one line on stderr, never a traceback:

    0  success (status: in sync)        2  bad configuration or usage
    1  runtime failure (store, restore)   75  stopped with changes still pending (sync), or fenced (run)
    status: 1 when not in sync; run: the child's own code (128+N for signal N)
"""

from __future__ import annotations

import sys
from collections.abc import Iterator

from sidecar import log

EXIT_OK, EXIT_FAIL, EXIT_CONFIG, EXIT_PENDING = 0, 1, 2, 75


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
