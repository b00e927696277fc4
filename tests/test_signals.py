"""server/signals.py: which signals stop a server, in-process (no signal is sent)."""

from __future__ import annotations

import asyncio
import signal

from batchd.server.signals import STOPS, on_signals


def _installed() -> dict[int, object]:
    async def body() -> dict[int, object]:
        on_signals()
        try:
            return {sig: signal.getsignal(sig) for sig in STOPS}
        finally:
            for sig in STOPS:
                asyncio.get_running_loop().remove_signal_handler(sig)

    return asyncio.run(body())


def test_sighup_stops_the_server_unless_it_was_ignored_as_it_started() -> None:
    """SIGHUP (a closed terminal's) stops the server as SIGTERM does; under nohup, which
    ignores it, it stayed ignored till the stop signals were the server's from its
    first line, and then stopped a server started so (late review 58e)."""
    saved = {sig: signal.getsignal(sig) for sig in STOPS}
    try:
        signal.signal(signal.SIGHUP, signal.SIG_DFL)
        handled = _installed()
        assert all(h not in (signal.SIG_DFL, signal.SIG_IGN) for h in handled.values())
        signal.signal(signal.SIGHUP, signal.SIG_IGN)  # nohup's
        assert _installed()[signal.SIGHUP] == signal.SIG_IGN
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)  # type: ignore[arg-type]
