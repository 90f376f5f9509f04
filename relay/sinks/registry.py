"""The kinds of sink the relay knows: adding one is a package under relay/sinks/ and a line
here (see docs/architecture.md)."""

from __future__ import annotations

from relay.sinks import SinkKind, endpoints, kafka, webhook

KINDS: dict[str, SinkKind] = {k.name: k for k in (kafka.KIND, webhook.KIND, endpoints.KIND)}
