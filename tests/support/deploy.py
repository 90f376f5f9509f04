"""Reading the deploy artifacts, and the names they must agree with (taken from the code).

Every valid name is derived from ``relay.config.Settings`` and the click CLI ``relay.cli.main``,
so renaming a setting or an option breaks the deploy tests instead of the deployments.
"""

from __future__ import annotations

import json
import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import click
import yaml
from dockerfile_parse import DockerfileParser
from pydantic import BaseModel, TypeAdapter, ValidationError

from relay.cli import main as cli_main
from relay.settings import settings_model

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
K8S = DEPLOY / "kubernetes"


# --- YAML ----------------------------------------------------------------------------------


def yaml_docs(path: Path) -> list[dict[str, Any]]:
    docs = [d for d in yaml.safe_load_all(path.read_text()) if d is not None]
    assert all(isinstance(d, dict) for d in docs), path
    return docs


def k8s_objects() -> dict[tuple[str, str], dict[str, Any]]:
    """Every object in deploy/kubernetes/*.yaml but the kustomization, by (kind, name)."""
    out: dict[tuple[str, str], dict[str, Any]] = {}
    for path in sorted(K8S.glob("*.yaml")):
        if path.name == "kustomization.yaml":
            continue
        for doc in yaml_docs(path):
            key = (doc["kind"], doc["metadata"]["name"])
            assert key not in out, f"{key} defined twice"
            out[key] = doc
    return out


# --- Dockerfiles ---------------------------------------------------------------------------


@dataclass
class Stage:
    base: str
    name: str | None
    instructions: list[tuple[str, str]] = field(default_factory=list)

    def all(self, instruction: str) -> list[str]:
        return [v for i, v in self.instructions if i == instruction]

    def last(self, instruction: str) -> str | None:
        found = self.all(instruction)
        return found[-1] if found else None


def dockerfile_stages(path: Path) -> list[Stage]:
    parser = DockerfileParser(path=str(path), env_replace=False)
    args: dict[str, str] = {}
    stages: list[Stage] = []
    for item in parser.structure:
        instruction, value = item["instruction"], item["value"]
        if instruction == "COMMENT":
            continue
        if instruction == "ARG" and not stages:
            name, _, default = value.partition("=")
            args[name.strip()] = default.strip()
        elif instruction == "FROM":
            m = re.fullmatch(r"(\S+)(?:\s+AS\s+(\S+))?", value.strip(), re.IGNORECASE)
            assert m, f"cannot read FROM {value!r}"
            base = re.sub(r"\$\{(\w+)\}", lambda g: args[g.group(1)], m.group(1))
            stages.append(Stage(base=base, name=m.group(2)))
        else:
            assert stages, f"{instruction} before FROM in {path}"
            stages[-1].instructions.append((instruction, value))
    return stages


def exec_form(value: str) -> list[str]:
    """A JSON-array (exec form) instruction value; shell form is refused."""
    parsed = json.loads(value)
    assert isinstance(parsed, list) and all(isinstance(a, str) for a in parsed), value
    return parsed


# --- the CLI -------------------------------------------------------------------------------


def cli_commands() -> dict[str, click.Command]:
    assert isinstance(cli_main, click.Group)
    ctx = click.Context(cli_main)
    found = {n: cli_main.get_command(ctx, n) for n in cli_main.list_commands(ctx)}
    return {n: c for n, c in found.items() if c is not None}


def cli_envvars() -> set[str]:
    names: set[str] = set()
    for cmd in cli_commands().values():
        for p in cmd.params:
            env = getattr(p, "envvar", None)
            if isinstance(env, str):
                names.add(env)
            elif env:
                names.update(env)
    return names


def check_cli_args(args: list[str]) -> list[str]:
    """Problems with ``outbox-relay ARGS`` as the click CLI sees them (empty when valid)."""
    commands = cli_commands()
    if not args or args[0] not in commands:
        return [f"{args[:1]} is not an outbox-relay command (have {sorted(commands)})"]
    cmd = commands[args[0]]
    options = {o: p for p in cmd.params if isinstance(p, click.Option) for o in p.opts}
    problems = []
    rest = iter(args[1:])
    for token in rest:
        name = token.split("=", 1)[0]
        if not token.startswith("-"):
            problems.append(f"unexpected argument {token!r} to {args[0]}")
        elif name not in options:
            problems.append(f"{args[0]} has no option {name} (have {sorted(options)})")
        elif not options[name].is_flag and "=" not in token:
            next(rest, None)  # its value
    return problems


# --- the settings --------------------------------------------------------------------------


def _section_model(name: str) -> type[BaseModel] | None:
    annotation = settings_model().model_fields[name].annotation
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    return None


def settings_env_names() -> set[str]:
    """Every env var the relay's settings read: OUTBOX_<KEY>, OUTBOX_<SECTION>_<KEY>."""
    prefix = str(settings_model().model_config.get("env_prefix", ""))
    names = set()
    for name in settings_model().model_fields:
        names.add(f"{prefix}{name}".upper())
        section = _section_model(name)
        if section is not None:
            for key, f in section.model_fields.items():
                names.add(f"{prefix}{name}_{f.alias or key}".upper())
    return names


def known_destination_kinds() -> set[str]:
    """The ``kind`` values the destination union accepts, found by asking the validator."""
    adapter = TypeAdapter(settings_model().model_fields["destinations"].annotation)
    kinds = set()
    for kind in ("kafka", "webhook"):
        try:
            adapter.validate_python({"x": {"kind": kind}})
        except ValidationError as exc:
            if any(e["type"] == "union_tag_invalid" for e in exc.errors()):
                continue
        kinds.add(kind)
    return kinds


def read_toml(text: str) -> dict[str, Any]:
    return tomllib.loads(text)
