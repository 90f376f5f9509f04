"""The AsyncAPI project's own parser (@asyncapi/parser, Node.js) for the document's tests.

Pinned by tests/asyncapi/package-lock.json and installed from it into
tests/asyncapi/node_modules when the lock changed (a stamp file named by the lock's hash says
it is done). No offline mirror exists: the first run needs the npm registry, later ones npm's
cache. Node.js and npm are installed here when missing (CI runs on a fresh machine), with apt as
root, as tests/support/browser.py installs Chromium.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parents[1] / "asyncapi"
LOCK = HERE / "package-lock.json"
CHECK = HERE / "check.js"
NPM_TIMEOUT = 300


def parser() -> Path:
    """tests/asyncapi, with its node_modules installed from the lock."""
    _tools()
    stamp = HERE / "node_modules" / f".stamp-{hashlib.sha1(LOCK.read_bytes()).hexdigest()}"
    if stamp.exists():
        return HERE
    # The suite's workers (pytest-xdist) may all get here at once; npm ci takes one at a time.
    with (Path(tempfile.gettempdir()) / "outbox-tests-asyncapi.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not stamp.exists():
            _install()
            stamp.touch()
    return HERE


def check(paths: list[Path]) -> list[dict[str, Any]]:
    """What check.js reports of each document, in one node process (loading the parser costs
    more than a second)."""
    node = shutil.which("node")
    assert node is not None
    done = subprocess.run(
        [node, str(CHECK), *map(str, paths)],
        cwd=parser(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    if done.returncode != 0:
        raise RuntimeError(f"check.js failed: {done.stderr[-4000:]}")
    found: list[dict[str, Any]] = json.loads(done.stdout)
    return found


def _install() -> None:
    npm = shutil.which("npm")
    assert npm is not None
    cmd = [npm, "ci", "--ignore-scripts", "--no-audit", "--no-fund", "--prefer-offline"]
    done = subprocess.run(cmd, cwd=HERE, capture_output=True, text=True, timeout=NPM_TIMEOUT)
    if done.returncode != 0:
        raise RuntimeError(
            f"{' '.join(cmd[1:])} in {HERE} failed (it needs the npm registry, or npm's cache, "
            f"the first time): {done.stderr[-2000:]}"
        )


def _tools() -> None:
    """node and npm on PATH, installing Debian's packages when they are not."""
    if shutil.which("node") and shutil.which("npm"):
        return
    with (Path(tempfile.gettempdir()) / "outbox-tests-nodejs.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if shutil.which("node") and shutil.which("npm"):
            return
        if os.geteuid() != 0 or shutil.which("apt-get") is None:
            raise RuntimeError(
                "the AsyncAPI document's tests need Node.js and npm: install them (apt-get "
                "install -y nodejs npm) or put node and npm on PATH"
            )
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        for cmd in (
            ["apt-get", "update", "-qq"],
            ["apt-get", "install", "-y", "-qq", "nodejs", "npm"],
        ):
            done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
            if done.returncode != 0:
                raise RuntimeError(f"{' '.join(cmd)} failed: {done.stderr[-2000:]}")
        if not (shutil.which("node") and shutil.which("npm")):
            raise RuntimeError("apt-get installed nodejs and npm, but they are not on PATH")
