"""How every command line of the project reports an error: one line on stderr naming what is
wrong (the file, key, URL or flag at fault, as the exception says it) and a non-zero exit status;
`--debug` shows the full traceback instead. Credentials in that line and in the command's log
lines are masked (defrag.urls.redact).
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import gc
import logging
import sys
from collections.abc import Iterator

from defrag.urls import redact

log = logging.getLogger(__name__)

# A command holds ~1M objects of torch, torchvision and MLflow, which the collections of
# Python's exit walk again and again (~1.6 s of every command); frozen, they are freed unwalked.
atexit.register(gc.freeze)

# Errors whose message is the whole story; anything else is named by its type as well.
SELF_EXPLAINING = (ValueError, RuntimeError, OSError, LookupError)


def add_debug_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--debug", action="store_true",
                        help="on an error, print the full traceback instead of one line")


def describe(err: BaseException) -> str:
    """An exception in one line: its message, prefixed by its type where the message alone
    would not say what happened."""
    text = " ".join(str(err).split())
    if isinstance(err, SELF_EXPLAINING) and text and type(err) not in (KeyError, IndexError):
        return text
    return f"{type(err).__name__}: {text}" if text else type(err).__name__


class RedactingFilter(logging.Filter):
    """Masks credentials in the message of every log record a handler emits."""

    def filter(self, record: logging.LogRecord) -> bool:
        with contextlib.suppress(TypeError, ValueError):  # a bad format: the handler reports it
            record.msg, record.args = redact(record.getMessage()), None
        return True


@contextlib.contextmanager
def one_line_errors(prog: str, debug: bool = False) -> Iterator[None]:
    """Run a command's work: an exception becomes `prog: error: ...` on stderr and exit status 1
    (the traceback at debug level in the log); with `debug` it propagates with its traceback.
    Meanwhile the root logger's handlers mask credentials (RedactingFilter)."""
    handlers, masking = list(logging.getLogger().handlers), RedactingFilter()
    for handler in handlers:
        handler.addFilter(masking)
    try:
        yield
    except Exception as err:
        if debug:
            raise
        log.debug("%s failed", prog, exc_info=True)
        sys.exit(f"{prog}: error: {redact(describe(err))} (--debug shows the traceback)")
    finally:
        for handler in handlers:
            handler.removeFilter(masking)
