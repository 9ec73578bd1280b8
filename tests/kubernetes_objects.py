"""Kubernetes documents as the kubernetes client's typed models: shared by the deploy and TorchX tests."""

from __future__ import annotations

import json
from typing import Any

from kubernetes.client import ApiClient


class _Response:
    """What ``ApiClient.deserialize`` reads: a body in ``data``."""

    def __init__(self, document: Any) -> None:
        self.data = json.dumps(document)


def typed(document: dict[str, Any], model: str) -> Any:
    """``document`` as the client's ``model``; fails on a missing required field or one the model does not know."""
    client = ApiClient()
    instance = client.deserialize(_Response(document), model)
    assert client.sanitize_for_serialization(instance) == document, f"fields {model} does not know, or mistyped"
    return instance
