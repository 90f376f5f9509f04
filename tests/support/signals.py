"""Children that Ctrl-C reaches: a suite started in the background (`./scripts/test &`, a CI
runner's job) runs with SIGINT ignored, which a child inherits, and Python then installs no
handler for it. A test that presses Ctrl-C starts its child with SIGINT's default action, as
a command typed at a terminal has (pass ``preexec_fn=ctrl_c_default``)."""

from __future__ import annotations

import signal


def ctrl_c_default() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)
