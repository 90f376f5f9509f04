"""The deploy artifacts agree with the code: commands, options, settings, env vars and ports.

No container engine runs here, so the files are parsed and checked against ``relay.cli.main``
and ``relay.config.Settings``; the Kubernetes manifests are validated against the bundled
Kubernetes JSON schemas (kubernetes-validate, offline); the image's health check command runs.
"""

from __future__ import annotations

import shlex
import subprocess
import sys
import threading
import tomllib
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import PurePosixPath
from typing import Any
from urllib.parse import urlsplit

import kubernetes_validate
import pytest
from example_app import main as example_app

from relay.app import FINAL_BUDGET
from relay.config import HttpSettings, Settings
from relay.settings import settings_model
from tests.support.deploy import (
    DEPLOY,
    K8S,
    REPO,
    check_cli_args,
    cli_envvars,
    dockerfile_stages,
    exec_form,
    k8s_objects,
    read_toml,
    settings_env_names,
    yaml_docs,
)

RELAY_DOCKERFILE = DEPLOY / "Dockerfile"
APP_DOCKERFILE = DEPLOY / "example-app" / "Dockerfile"
COMPOSE = DEPLOY / "compose.yaml"
ROLE_SQL = DEPLOY / "sql" / "relay_role.sql"


def valid_env_names() -> set[str]:
    return settings_env_names() | cli_envvars()


def outbox_env(env: dict[str, Any]) -> set[str]:
    return {k for k in env if k.startswith("OUTBOX_")}


def load_settings_with(
    monkeypatch: pytest.MonkeyPatch, config: dict[str, Any], env: dict[str, str]
) -> Settings:
    """``Settings`` as the relay builds them: the file's values, overridden by ``env``."""
    import os

    for name in list(os.environ):
        if name.startswith("OUTBOX_"):
            monkeypatch.delenv(name)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    return settings_model()(**config)


def http_port(config: dict[str, Any]) -> int:
    return HttpSettings(**config.get("http", {})).port


def deploy_configs() -> dict[str, dict[str, Any]]:
    (configmap,) = [d for d in yaml_docs(K8S / "configmap.yaml") if "relay.toml" in d["data"]]
    return {
        "deploy/relay.toml": read_toml((DEPLOY / "relay.toml").read_text()),
        "deploy/kubernetes/configmap.yaml": read_toml(configmap["data"]["relay.toml"]),
    }


def test_deploy_configs_validate_whole(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every relay.toml we ship loads as the relay would load it (secrets from the env)."""
    import base64

    for config in deploy_configs().values():
        for dest in config.get("destinations", {}).values():
            if "secret_env" in dest:
                monkeypatch.setenv(
                    dest["secret_env"], "whsec_" + base64.b64encode(b"k" * 32).decode()
                )
        settings_model()(database_url="postgresql://relay@db/app", **config)


# --- the relay image -----------------------------------------------------------------------


def test_relay_image_is_multi_stage_slim_and_non_root() -> None:
    stages = dockerfile_stages(RELAY_DOCKERFILE)
    assert len(stages) >= 2
    assert all(s.base.startswith("python:") and s.base.endswith("-slim") for s in stages)
    final = stages[-1]
    # Nothing is built or fetched in the final stage: it only copies the built virtualenv.
    for run in final.all("RUN"):
        assert not any(w in run for w in ("pip ", "apt-get", "apk ", "gcc", "build-essential"))
    for copy in final.all("COPY"):
        assert copy.startswith("--from="), f"final stage copies from the build context: {copy}"
    user = final.last("USER")
    assert user is not None
    uid = user.split(":")[0]
    assert uid.isdigit() and int(uid) != 0, "a numeric non-root user (runAsNonRoot checks it)"


def test_relay_image_entrypoint_is_the_console_script() -> None:
    final = dockerfile_stages(RELAY_DOCKERFILE)[-1]
    entrypoint = exec_form(final.last("ENTRYPOINT") or "")
    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    assert entrypoint == ["outbox-relay"]
    assert scripts["outbox-relay"] == "relay.cli:main"


def test_relay_image_default_command_is_run_with_the_mounted_config() -> None:
    cmd = exec_form(dockerfile_stages(RELAY_DOCKERFILE)[-1].last("CMD") or "")
    assert cmd == ["run", "--config", "/etc/outbox-relay/relay.toml"]
    assert check_cli_args(cmd) == []


def test_relay_image_exposes_the_http_port() -> None:
    final = dockerfile_stages(RELAY_DOCKERFILE)[-1]
    config = read_toml((DEPLOY / "relay.toml").read_text())
    assert final.all("EXPOSE") == [str(http_port(config))]
    assert final.last("STOPSIGNAL") == "SIGTERM"


def test_copied_sources_exist_and_are_not_docker_ignored() -> None:
    ignored = {
        line.strip()
        for line in (REPO / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    }
    for dockerfile in (RELAY_DOCKERFILE, APP_DOCKERFILE):
        for stage in dockerfile_stages(dockerfile):
            for copy in stage.all("COPY"):
                if copy.startswith("--from="):
                    continue
                *sources, _dest = copy.split()
                for src in sources:
                    assert (REPO / src).exists(), f"{dockerfile.name}: COPY {src} is missing"
                    assert PurePosixPath(src).parts[0] not in ignored, src


class _Health(BaseHTTPRequestHandler):
    status = 200
    paths: list[str] = []  # noqa: RUF012 - shared by the handler instances of one server

    def do_GET(self) -> None:
        self.paths.append(self.path)
        self.send_response(self.status)
        self.send_header("content-length", "0")
        self.end_headers()

    def log_message(self, format: str, *args: object) -> None:
        pass


@pytest.fixture
def health_server() -> Iterator[ThreadingHTTPServer]:
    handler = type("Handler", (_Health,), {"paths": [], "status": 200})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)


def healthcheck_argv(dockerfile: Any) -> list[str]:
    value = dockerfile_stages(dockerfile)[-1].last("HEALTHCHECK") or ""
    _, sep, cmd = value.partition("CMD ")
    assert sep, value
    argv = exec_form(cmd)
    assert argv[0] == "python"
    return [sys.executable, *argv[1:]]


def test_relay_image_health_check_asks_healthz_on_the_configured_port(
    health_server: ThreadingHTTPServer,
) -> None:
    argv = healthcheck_argv(RELAY_DOCKERFILE)
    port = str(health_server.server_address[1])
    handler: Any = health_server.RequestHandlerClass
    env = {"OUTBOX_HTTP_PORT": port, "PATH": "/usr/bin:/bin"}

    ok = subprocess.run(argv, env=env, capture_output=True, timeout=10)
    assert ok.returncode == 0, ok.stderr
    handler.status = 503
    failing = subprocess.run(argv, env=env, capture_output=True, timeout=10)
    assert failing.returncode != 0
    assert handler.paths == ["/healthz", "/healthz"]


def test_example_app_image() -> None:
    stages = dockerfile_stages(APP_DOCKERFILE)
    assert len(stages) >= 2
    assert all(s.base.startswith("python:") and s.base.endswith("-slim") for s in stages)
    final = stages[-1]
    user = (final.last("USER") or "0").split(":")[0]
    assert user.isdigit() and int(user) != 0
    entrypoint = exec_form(final.last("ENTRYPOINT") or "")
    cmd = exec_form(final.last("CMD") or "")
    assert entrypoint == ["uvicorn", "example_app.main:app"]
    assert cmd[cmd.index("--port") + 1] == final.last("EXPOSE") == "8000"
    assert "--host" in cmd and cmd[cmd.index("--host") + 1] == "0.0.0.0"


# --- docker compose ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    (doc,) = yaml_docs(COMPOSE)
    return doc


def service_env(service: dict[str, Any]) -> dict[str, str]:
    env = service.get("environment", {})
    if isinstance(env, list):
        env = dict(item.split("=", 1) for item in env)
    return {k: str(v) for k, v in env.items()}


def relay_image_services(compose: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {
        name: s
        for name, s in compose["services"].items()
        if s.get("build", {}).get("dockerfile") == "deploy/Dockerfile"
    }


def test_compose_has_the_whole_stack(compose: dict[str, Any]) -> None:
    services = compose["services"]
    assert set(services) == {"postgres", "kafka", "migrate", "db-roles", "relay", "app"}
    assert services["postgres"]["image"].startswith("postgres:")
    kafka = services["kafka"]
    assert kafka["image"].startswith("apache/kafka:")
    env = service_env(kafka)
    assert set(env["KAFKA_PROCESS_ROLES"].split(",")) == {"broker", "controller"}  # KRaft
    assert env["KAFKA_CONTROLLER_QUORUM_VOTERS"] == f"{env['KAFKA_NODE_ID']}@kafka:9093"
    assert not any("ZOOKEEPER" in k for k in env)
    assert set(relay_image_services(compose)) == {"migrate", "relay"}
    assert services["app"]["build"]["dockerfile"] == "deploy/example-app/Dockerfile"
    for name, service in services.items():
        if "build" in service:
            assert (COMPOSE.parent / service["build"]["context"]).resolve() == REPO, name


def test_compose_commands_are_cli_commands(compose: dict[str, Any]) -> None:
    services = relay_image_services(compose)
    assert check_cli_args(services["migrate"]["command"]) == []
    assert services["migrate"]["command"][0] == "migrate"
    assert check_cli_args(services["relay"]["command"]) == []
    assert services["relay"]["command"][0] == "run"


def test_compose_env_names_are_read_by_the_relay_and_the_app(compose: dict[str, Any]) -> None:
    valid = valid_env_names()
    for name, service in relay_image_services(compose).items():
        env = service_env(service)
        unknown = outbox_env(env) - valid
        assert not unknown, f"{name}: not read by the relay: {unknown}"
        assert "OUTBOX_DATABASE_URL" in env
    app_env = service_env(compose["services"]["app"])
    assert set(app_env) == set(example_app.ENV_VARS)


def test_compose_relay_config_loads_and_reaches_the_stack(
    compose: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    relay = compose["services"]["relay"]
    mounts = dict(v.split(":")[:2] for v in relay["volumes"])
    config_path = relay["command"][relay["command"].index("--config") + 1]
    host_file = (COMPOSE.parent / next(h for h, c in mounts.items() if c == config_path)).resolve()
    config = read_toml(host_file.read_text())
    settings = load_settings_with(monkeypatch, config, service_env(relay))

    # The relay reads the example app's destination and delivers it to the stack's Kafka.
    kafka_env = service_env(compose["services"]["kafka"])
    advertised = kafka_env["KAFKA_ADVERTISED_LISTENERS"].split("://", 1)[1]
    assert settings.kafka.bootstrap_servers == advertised
    assert settings.destinations[example_app.ORDERS_DESTINATION].topic == "orders"

    # It logs in as the role db-roles creates, to the database the app and migrate use.
    roles_cmd = compose["services"]["db-roles"]["command"]
    psql_vars = dict(roles_cmd[i + 1].split("=", 1) for i, a in enumerate(roles_cmd) if a == "-v")
    relay_url = urlsplit(settings.database_url.get_secret_value())
    assert (relay_url.username, relay_url.password) == (psql_vars["role"], psql_vars["password"])
    assert psql_vars["schema"] == settings.relay.db_schema
    owner_url = urlsplit(service_env(compose["services"]["migrate"])["OUTBOX_DATABASE_URL"])
    app_url = urlsplit(service_env(compose["services"]["app"])["APP_DATABASE_URL"])
    assert relay_url.hostname == owner_url.hostname == app_url.hostname == "postgres"
    assert relay_url.path == owner_url.path == app_url.path
    assert (COMPOSE.parent / "sql" / PurePosixPath(roles_cmd[-1]).name) == ROLE_SQL

    # Published ports: loopback only; the relay's is its HTTP port.
    assert relay["ports"] == [f"127.0.0.1:{http_port(config)}:{http_port(config)}"]
    assert all(
        p.startswith("127.0.0.1:") for s in compose["services"].values() for p in s.get("ports", [])
    )
    # Stopping waits for the drain.
    grace = int(relay["stop_grace_period"].rstrip("s"))
    assert grace > settings.relay.shutdown_timeout + FINAL_BUDGET


def test_compose_start_order(compose: dict[str, Any]) -> None:
    services = compose["services"]

    def after(name: str) -> dict[str, str]:
        return {k: v["condition"] for k, v in services[name]["depends_on"].items()}

    assert after("migrate") == {"postgres": "service_healthy"}
    assert after("db-roles") == {"migrate": "service_completed_successfully"}
    assert after("relay") == {
        "db-roles": "service_completed_successfully",
        "kafka": "service_healthy",
    }
    assert after("app") == {"migrate": "service_completed_successfully"}
    for name in ("postgres", "kafka"):
        assert services[name]["healthcheck"]["test"][0] == "CMD"
    for name in ("migrate", "db-roles"):
        assert services[name]["restart"] == "no"
    for service in services.values():
        for volume in service.get("volumes", []):
            source = volume.split(":")[0]
            if source.startswith("."):
                assert (COMPOSE.parent / source).exists(), source


# --- Kubernetes ----------------------------------------------------------------------------

CRD_KINDS = {"ServiceMonitor"}


@pytest.fixture(scope="module")
def k8s() -> dict[tuple[str, str], dict[str, Any]]:
    return k8s_objects()


@pytest.mark.parametrize("version", ["1.29.0", "1.37.0"])
def test_manifests_validate_against_kubernetes_schemas(
    k8s: dict[tuple[str, str], dict[str, Any]], version: str
) -> None:
    validated = 0
    for (kind, name), obj in k8s.items():
        if kind in CRD_KINDS:
            continue
        try:
            kubernetes_validate.validate(obj, version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            pytest.fail(f"{kind}/{name} against {version}: {str(exc).splitlines()[0]}")
        validated += 1
    assert validated == len(k8s) - 1


def test_a_misspelt_field_fails_validation(k8s: dict[tuple[str, str], dict[str, Any]]) -> None:
    deployment = k8s[("Deployment", "orders")]
    broken = yaml_docs(K8S / "deployment.yaml")[0]
    broken["spec"]["template"]["spec"]["terminationGracePeriod"] = 45
    kubernetes_validate.validate(deployment, "1.37.0", strict=True)
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, "1.37.0", strict=True)


def test_kustomization_lists_every_manifest(k8s: dict[tuple[str, str], dict[str, Any]]) -> None:
    (kustomization,) = yaml_docs(K8S / "kustomization.yaml")
    files = {p.name for p in K8S.glob("*.yaml")} - {"kustomization.yaml", "servicemonitor.yaml"}
    assert set(kustomization["resources"]) == files
    images = {i["name"] for i in kustomization["images"]}
    used = {
        c["image"]
        for obj in k8s.values()
        if obj["kind"] in ("Deployment", "Job")
        for c in pod_spec(obj).get("containers", []) + pod_spec(obj).get("initContainers", [])
    }
    assert images == used - {"postgres:17-alpine"}


def pod_spec(obj: dict[str, Any]) -> dict[str, Any]:
    spec: dict[str, Any] = obj["spec"]["template"]["spec"]
    return spec


def containers(obj: dict[str, Any]) -> dict[str, dict[str, Any]]:
    spec = pod_spec(obj)
    return {c["name"]: c for c in spec.get("initContainers", []) + spec["containers"]}


def relay_toml_from_configmap(
    k8s: dict[tuple[str, str], dict[str, Any]], container: dict[str, Any], pod: dict[str, Any]
) -> tuple[str, dict[str, Any]]:
    config_path = PurePosixPath(container["args"][container["args"].index("--config") + 1])
    (mount,) = [m for m in container["volumeMounts"] if m["mountPath"] == str(config_path.parent)]
    (volume,) = [v for v in pod["volumes"] if v["name"] == mount["name"]]
    configmap = k8s[("ConfigMap", volume["configMap"]["name"])]
    return configmap["metadata"]["name"], read_toml(configmap["data"][config_path.name])


def resolved_env(
    k8s: dict[tuple[str, str], dict[str, Any]], container: dict[str, Any]
) -> dict[str, str]:
    """The container's environment, with secretKeyRefs looked up in the Secret manifests."""
    env = {}
    for var in container.get("env", []):
        if "value" in var:
            env[var["name"]] = str(var["value"])
            continue
        source = var["valueFrom"]
        if "secretKeyRef" in source:
            ref = source["secretKeyRef"]
            secret = k8s[("Secret", ref["name"])]
            assert ref["key"] in secret["stringData"], f"{var['name']}: no key {ref['key']}"
            env[var["name"]] = secret["stringData"][ref["key"]]
        else:
            assert source["fieldRef"]["fieldPath"] == "metadata.name"
            env[var["name"]] = "orders-7d9f8-abcde"
    return env


def test_relay_sidecar_config_and_env_match_the_settings(
    k8s: dict[tuple[str, str], dict[str, Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    deployment = k8s[("Deployment", "orders")]
    pod = pod_spec(deployment)
    assert set(containers(deployment)) == {"app", "outbox-relay"}
    relay = containers(deployment)["outbox-relay"]
    assert relay["image"] == "outbox-relay"
    assert check_cli_args(relay["args"]) == []

    _, config = relay_toml_from_configmap(k8s, relay, pod)
    env = resolved_env(k8s, relay)
    assert not outbox_env(env) - valid_env_names()
    settings = load_settings_with(monkeypatch, config, env)
    assert settings.relay.relay_id == "orders-7d9f8-abcde"  # the pod's name
    assert urlsplit(settings.database_url.get_secret_value()).username == "outbox_relay"
    assert settings.destinations[example_app.ORDERS_DESTINATION].topic == "orders"
    # Every webhook secret_env the relay reads is set from the Secret.
    for dest in config["destinations"].values():
        if "secret_env" in dest:
            assert env.get(dest["secret_env"]), dest["secret_env"]

    # Draining fits in the grace period, with a margin; the relay needs no preStop hook:
    # SIGTERM is its drain signal, and it is PID 1 in its container.
    assert "lifecycle" not in relay
    assert pod["terminationGracePeriodSeconds"] > settings.relay.shutdown_timeout + FINAL_BUDGET
    assert pod["enableServiceLinks"] is False

    app = containers(deployment)["app"]
    assert {e["name"] for e in app["env"]} == set(example_app.ENV_VARS)
    resolved_env(k8s, app)


def test_relay_sidecar_probes_and_metrics_port(
    k8s: dict[tuple[str, str], dict[str, Any]],
) -> None:
    deployment = k8s[("Deployment", "orders")]
    relay = containers(deployment)["outbox-relay"]
    _, config = relay_toml_from_configmap(k8s, relay, pod_spec(deployment))
    ports = {p["name"]: p["containerPort"] for p in relay["ports"]}
    assert ports == {"metrics": http_port(config)}
    probes = {
        kind: (relay[kind]["httpGet"]["path"], relay[kind]["httpGet"]["port"])
        for kind in ("startupProbe", "livenessProbe", "readinessProbe")
    }
    assert probes == {
        "startupProbe": ("/healthz", "metrics"),
        "livenessProbe": ("/healthz", "metrics"),
        "readinessProbe": ("/readyz", "metrics"),
    }
    assert config["http"]["host"] == "0.0.0.0"  # the kubelet probes the pod IP

    service = k8s[("Service", "orders")]
    selector = service["spec"]["selector"]
    assert selector.items() <= deployment["spec"]["template"]["metadata"]["labels"].items()
    pod_ports = {p["name"] for c in containers(deployment).values() for p in c.get("ports", [])}
    assert {p["targetPort"] for p in service["spec"]["ports"]} <= pod_ports
    assert "metrics" in {p["name"] for p in service["spec"]["ports"]}

    # The optional ServiceMonitor scrapes that port of that Service.
    (monitor,) = yaml_docs(K8S / "servicemonitor.yaml")
    assert (
        monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    )
    assert [(e["port"], e["path"]) for e in monitor["spec"]["endpoints"]] == [
        ("metrics", "/metrics")
    ]


def test_every_container_has_requests_limits_and_a_locked_down_context(
    k8s: dict[tuple[str, str], dict[str, Any]],
) -> None:
    for (kind, name), obj in k8s.items():
        if kind not in ("Deployment", "Job"):
            continue
        assert pod_spec(obj)["securityContext"]["runAsNonRoot"] is True
        for cname, c in containers(obj).items():
            where = f"{kind}/{name}/{cname}"
            for bound in ("requests", "limits"):
                assert set(c["resources"][bound]) == {"cpu", "memory"}, where
            ctx = c["securityContext"]
            assert ctx["allowPrivilegeEscalation"] is False, where
            assert ctx["readOnlyRootFilesystem"] is True, where
            assert ctx["capabilities"]["drop"] == ["ALL"], where


def test_migration_job_migrates_then_grants_the_relay_role(
    k8s: dict[tuple[str, str], dict[str, Any]],
) -> None:
    job = k8s[("Job", "orders-outbox-migrate")]
    spec = pod_spec(job)
    assert spec["restartPolicy"] == "Never"
    (migrate,) = spec["initContainers"]
    assert migrate["image"] == "outbox-relay"
    assert check_cli_args(migrate["args"]) == []
    assert migrate["args"][0] == "migrate"
    env = resolved_env(k8s, migrate)
    assert outbox_env(env) <= cli_envvars() & {"OUTBOX_DATABASE_URL", "OUTBOX_SCHEMA"}

    # The grant step runs deploy/sql/relay_role.sql, shipped in a ConfigMap kept identical.
    (grant,) = spec["containers"]
    sql_volume = next(v for v in spec["volumes"] if v["name"] == grant["volumeMounts"][0]["name"])
    sql_map = k8s[("ConfigMap", sql_volume["configMap"]["name"])]
    assert sql_map["data"]["relay_role.sql"] == ROLE_SQL.read_text()
    script = shlex.split(grant["command"][-1])
    assert (
        script[script.index("-f") + 1] == f"{grant['volumeMounts'][0]['mountPath']}/relay_role.sql"
    )
    psql_vars = dict(script[i + 1].split("=", 1) for i, a in enumerate(script) if a == "-v")
    grant_env = resolved_env(k8s, grant)
    assert grant_env["OWNER_URL"] == env["OUTBOX_DATABASE_URL"]

    # The role and password it sets are the ones the relay sidecar logs in with.
    relay = containers(k8s[("Deployment", "orders")])["outbox-relay"]
    relay_url = urlsplit(resolved_env(k8s, relay)["OUTBOX_DATABASE_URL"])
    assert psql_vars["role"] == relay_url.username
    assert psql_vars["password"] == "$RELAY_PASSWORD"
    assert grant_env["RELAY_PASSWORD"] == relay_url.password
    assert psql_vars["schema"] == env["OUTBOX_SCHEMA"]
