"""The package as pip installs it: the wheel built from this checkout, in a virtualenv of its own
outside the repository.

Installing the dependencies takes 15-30 s, so a virtualenv is kept in the system's
temporary directory per set of requirements (the hash of what pyproject.toml asks for, and the
Python version): a later session only puts its freshly built wheel into it (two seconds).
Several test sessions on one machine (developers' worktrees, CI) may share one, so it is used
under a lock. Neither virtualenv has pip: the running interpreter's pip installs into them
(``pip --python``), which saves creating one per virtualenv.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import shutil
import subprocess
import sys
import tempfile
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
PYPROJECT = REPO / "pyproject.toml"
# The extras the wheel's virtualenv installs: what `outbox-relay demo` needs besides the base.
EXTRAS = "demo"


def _project() -> dict[str, Any]:
    return tomllib.loads(PYPROJECT.read_text())


def _key(requirements: object) -> str:
    text = json.dumps([requirements, sys.version], sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def pip(python: Path, *args: str, timeout: float = 600) -> None:
    """The running interpreter's pip, installing into ``python``'s environment."""
    done = subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(python), "--no-input", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=tempfile.gettempdir(),  # nothing of the checkout on the path
    )
    said = done.stdout[-3000:] + done.stderr[-3000:]
    assert done.returncode == 0, f"pip {' '.join(args)}:\n{said}"


@contextlib.contextmanager
def _locked(name: str) -> Iterator[None]:
    with open(Path(tempfile.gettempdir()) / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, or the process dies
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _venv(name: str, install: list[str]) -> tuple[Path, bool]:
    """The virtualenv ``name`` in the temporary directory, made with ``install`` in it if it
    does not exist yet; its python, and whether it was made now. The caller holds its lock."""
    home = Path(tempfile.gettempdir()) / name
    ready = home / "ready"  # written last: a virtualenv without it was left half made
    python = home / "bin" / "python"
    if ready.exists():
        return python, False
    # Made where it stays: its scripts name their interpreter by path.
    shutil.rmtree(home, ignore_errors=True)
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(home)], check=True)
    pip(python, "install", "--quiet", *install)
    ready.touch()
    return python, True


def build_wheel(out: Path) -> Path:
    """The wheel of this checkout, built in ``out`` by the build backend pyproject.toml names
    (installed once, in a virtualenv of its own)."""
    requires = _project()["build-system"]["requires"]
    name = f"outbox-relay-build-{_key(requires)}"
    with _locked(name):
        python, _ = _venv(name, requires)
    pip(python, "wheel", "--quiet", "--no-deps", "--no-build-isolation", "-w", str(out), str(REPO))
    (wheel,) = out.glob("outbox_relay-*.whl")
    return wheel


@contextlib.contextmanager
def installed(wheel: Path) -> Iterator[Path]:
    """A virtualenv with ``wheel`` and its ``demo`` extra installed, as
    ``pip install 'outbox-relay[demo]'`` leaves one; its bin directory. Held for this
    session alone while the block runs."""
    project = _project()["project"]
    requires = [project["dependencies"], project["optional-dependencies"].get(EXTRAS)]
    name = f"outbox-relay-wheel-{_key(requires)}"
    with _locked(name):
        python, made = _venv(name, [f"{wheel}[{EXTRAS}]"])
        if not made:  # by an earlier session: this session's code, the same requirements
            pip(python, "install", "--quiet", "--no-deps", "--force-reinstall", str(wheel))
        yield python.parent
