"""Acting on SIGTERM and SIGINT at once, whichever of the server's threads the kernel gives them.

Python runs a signal's handler in the main thread only, once that thread runs bytecode again,
and a signal that lands on another thread does not wake it. The torch engine's main thread
sleeps on its inbox while idle: when a burst of signals was taken off the queue by other threads,
the handler waited there until the next request or signal came (minutes, in a test that sent
300). Python's C-level handler also writes each signal's number to the wakeup socket, from
whichever thread took it; a thread reading that socket acts on the first one.
"""

from __future__ import annotations

import signal
import socket
import threading
from collections.abc import Callable

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


def on_first_stop_signal(act: Callable[[signal.Signals], None]) -> None:
    """Call `act` once, in a thread of its own, on the first SIGTERM or SIGINT; later ones are
    dropped. Call from the main thread, before other threads start."""
    reader, writer = socket.socketpair()
    writer.setblocking(False)  # the C handler must never block; a full buffer drops the byte
    for signum in STOP_SIGNALS:
        signal.signal(signum, _ignore)  # the C handler writes only for signals Python handles
    signal.set_wakeup_fd(writer.fileno(), warn_on_full_buffer=False)
    threading.Thread(target=_read, args=((reader, writer), act), name="signals",
                     daemon=True).start()


def _ignore(_signum: int, _frame: object) -> None:
    """The Python-level handler: the reading thread has acted already."""


def _read(pair: tuple[socket.socket, socket.socket],
          act: Callable[[signal.Signals], None]) -> None:
    # The pair's writer stays open while this thread reads: closed, the C handler's writes fail.
    acted = False
    while data := pair[0].recv(512):
        for number in data:
            if not acted and number in STOP_SIGNALS:
                acted = True
                act(signal.Signals(number))
