"""A real browser for the console's tests: Debian's Chromium, driven by Playwright.

Playwright's own browser download cannot work on these machines; the system Chromium can.
It is installed here when missing (CI runs on a fresh machine), with apt as root.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import tempfile
from pathlib import Path


def chromium() -> str:
    """The path of a Chromium executable, installing Debian's package when there is none."""
    found = shutil.which("chromium") or shutil.which("chromium-browser")
    if found:
        return found
    # The suite's workers (pytest-xdist) may all get here at once; apt takes one at a time.
    with (Path(tempfile.gettempdir()) / "outbox-tests-chromium.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        return shutil.which("chromium") or _install()


def _install() -> str:
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        raise RuntimeError(
            "the console's browser tests need Chromium: install it (apt-get install -y "
            "chromium) or put a chromium executable on PATH"
        )
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for cmd in (["apt-get", "update", "-qq"], ["apt-get", "install", "-y", "-qq", "chromium"]):
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed: {done.stderr[-2000:]}")
    found = shutil.which("chromium")
    if not found:
        raise RuntimeError("apt-get installed chromium, but it is not on PATH")
    return found
