"""The import rules of pyproject.toml ([tool.importlinter]) hold each a real rule: a copy of the
code with one forbidden import added fails `lint-imports`, naming the contract it breaks."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LINT = Path(sys.executable).with_name("lint-imports")

LAYERS = "relay layered"
CLIENTS = "operations, their commands and the console never import the message clients"
# (contract name's beginning, module file, line added to it): each rule broken in one place,
# and the wide ones in several, so that a source dropped from a rule is seen too.
BREAKS = {
    "layers": (LAYERS, "relay/db/store.py", "from relay.pipeline import claimer"),
    "layers-config-above-db": (LAYERS, "relay/config/base.py", "from relay.db import queries"),
    "layers-sinks-above-settings": (LAYERS, "relay/sinks/null.py", "import relay.settings"),
    "layers-outcomes-below-sinks": (LAYERS, "relay/outcomes.py", "from relay.sinks import null"),
    "layers-backoff-below-outcomes": (LAYERS, "relay/backoff.py", "from relay import outcomes"),
    "pipeline": (
        "the pipeline's stages layered",
        "relay/pipeline/completer.py",
        "def _later() -> None:\n    from relay.pipeline import claimer  # a lower stage\n",
    ),
    "outbox-free-of-relay": (
        "outbox never imports relay",
        "outbox/errors.py",
        "def _later() -> None:\n    import relay.obs.scrub  # a function-level import counts\n",
    ),
    "enqueue-without-catalog": (
        "enqueue never loads the catalog",
        "outbox/writer.py",
        "def _later() -> None:\n    from outbox.catalog import validation  # even lazily\n",
    ),
    "enqueue-without-catalog-validator": (
        "enqueue never loads the catalog",
        "outbox/message.py",
        "import jsonschema_rs",
    ),
    "sinks-apart": (
        "the kafka and webhook sinks never import the endpoints sink",
        "relay/sinks/webhook/client.py",
        "from relay.sinks.endpoints import store as _endpoints",
    ),
    "clients-ops": (CLIENTS, "relay/ops/status.py", "import httptools"),
    "clients-console-command": (CLIENTS, "relay/cli/ui.py", "import aiokafka"),
    "clients-settings": (CLIENTS, "relay/settings.py", "import httptools"),
    "portal-without-operator-powers": (
        "the tenant portal never imports the console or all-tenant operations",
        "relay/portal/scope.py",
        "from relay.ops import purge as _purge",
    ),
    "clients-portal": (CLIENTS, "relay/portal/reads.py", "import aiokafka"),
    "layers-portal-below-runtime": (LAYERS, "relay/portal/cursors.py", "import relay.runtime"),
    "clients-command-group": (
        "the command group never imports the message clients",
        "relay/cli/__init__.py",
        "import uvloop",
    ),
    "acyclic": (
        "no import circles",
        "relay/ui/security.py",
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from relay.ui import app\n",
    ),
}


def lint(tree: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    return subprocess.run(
        [str(LINT), "--no-cache"],
        cwd=tree,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.fixture(scope="module")
def pristine(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tree = tmp_path_factory.mktemp("rules")
    junk = shutil.ignore_patterns("__pycache__", "*.pyc", "static", "templates")
    for package in ("outbox", "relay"):
        shutil.copytree(ROOT / package, tree / package, ignore=junk)
    shutil.copy(ROOT / "pyproject.toml", tree / "pyproject.toml")
    done = lint(tree)
    # The copy is what is checked (not the installed checkout), and it keeps every rule.
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert "0 broken" in done.stdout
    return tree


@pytest.mark.parametrize("contract", sorted(BREAKS))
def test_breaking_a_rule_fails_the_check(pristine: Path, tmp_path: Path, contract: str) -> None:
    name, module, line = BREAKS[contract]
    tree = tmp_path / "tree"
    shutil.copytree(pristine, tree)
    target = tree / module
    target.write_text(target.read_text() + "\n" + line + "\n")
    done = lint(tree)
    assert done.returncode != 0, done.stdout[-3000:]
    broken = [x for x in done.stdout.splitlines() if " BROKEN" in x]
    assert any(x.startswith(name) for x in broken), done.stdout[-3000:]


def test_every_rule_is_broken_above() -> None:
    """A contract added to pyproject.toml gets a break here, or this fails."""
    contracts = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
    names = [c["name"] for c in contracts["contracts"]]
    unbroken = [n for n in names if not any(n.startswith(b[0]) for b in BREAKS.values())]
    assert not unbroken, unbroken
