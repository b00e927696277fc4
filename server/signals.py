"""The signals that stop a server (app.py): SIGINT, SIGTERM and SIGHUP, handled on the
event loop from the first thing serve() does."""

from __future__ import annotations

import asyncio
import signal

STOPS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)  # each stops the server
Signals = tuple[list[int], asyncio.Event, asyncio.Event]  # which came; stop; again


def on_signals() -> Signals:
    """SIGINT, SIGTERM and SIGHUP (a closed terminal's: it ended the server at once, 58c)
    set `stop`; the list says which came (SIGTERM, from a service manager or Kubernetes,
    and SIGHUP drain with the notice; SIGINT without). A SIGINT after the first signal
    sets `again`: it ends the notice. A second SIGTERM does not: one to the whole group
    (systemd) reaches each child frontend twice, frontend 0 passing it on."""
    got: list[int] = []
    stop, again, loop = asyncio.Event(), asyncio.Event(), asyncio.get_running_loop()

    def on_signal(sig: int) -> None:
        got.append(signal.SIGTERM if sig == signal.SIGHUP else sig)
        stop.set()
        if len(got) > 1 and sig == signal.SIGINT:
            again.set()

    for sig in STOPS:  # (a SIGHUP ignored as it started, nohup's, stays so: late review 58e)
        if not (sig == signal.SIGHUP and signal.getsignal(sig) == signal.SIG_IGN):
            loop.add_signal_handler(sig, on_signal, sig)
    return got, stop, again
