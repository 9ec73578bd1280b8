"""The entry of a worker process forked by a test: run it, then exit without the interpreter's teardown.

A process forked from the test's interpreter inherits its threads' state
(torch's thread pool among them) but not the threads: it must not enter that
pool, and its teardown would run the parent's exit handlers. So it runs with
one thread and leaves through ``os._exit`` with the entry's status (0, the
``SystemExit`` code, or 1 after printing an exception's traceback).
"""

from __future__ import annotations

import os
import sys
import traceback
from collections.abc import Callable
from typing import NoReturn

import torch


def run_forked(entry: Callable[[], None]) -> NoReturn:
    """Run ``entry()`` in this forked process, then ``os._exit`` with its status (see the module doc)."""
    torch.set_num_threads(1)  # forked from a process whose thread pool may have run: never enter it
    code = 1
    try:
        entry()
        code = 0
    except SystemExit as stop:
        code = stop.code if isinstance(stop.code, int) else 1
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
