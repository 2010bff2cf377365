"""A small offline `kustomize build` for deploy/k8s: resources (files, or a base directory), image
overrides and inline JSON 6902 patches (`add` only) of a kind and name, nothing else.

kustomize is not installed everywhere the tests run. A kustomization using any other field fails loudly
here instead of being rendered wrong.
"""

from __future__ import annotations

import os
from typing import Any

import yaml

SUPPORTED_FIELDS = {"apiVersion", "kind", "resources", "images", "patches"}


def render(directory: str) -> list[dict[str, Any]]:
    """The resources of directory/kustomization.yaml, in order, with its `images` applied."""
    with open(os.path.join(directory, "kustomization.yaml")) as f:
        kustomization = yaml.safe_load(f)
    unsupported = set(kustomization) - SUPPORTED_FIELDS
    if unsupported:
        raise ValueError(f"kustomization.yaml: fields {sorted(unsupported)} are not rendered by this helper")
    documents = []
    for resource in kustomization["resources"]:
        path = os.path.join(directory, resource)
        if os.path.isdir(path):  # a base this overlay builds on
            base, overlay = os.path.realpath(path), os.path.realpath(directory)
            if os.path.commonpath([base, overlay]) == base:  # kustomize: "cycle detected"
                raise ValueError(f"{resource}: a base may not contain the kustomization using it")
            documents.extend(render(path))
            continue
        with open(path) as f:
            documents.extend(doc for doc in yaml.safe_load_all(f) if doc is not None)
    for patch in kustomization.get("patches", []):
        target = patch["target"]
        (document,) = [
            d for d in documents if (d["kind"], d["metadata"]["name"]) == (target["kind"], target["name"])
        ]
        for operation in yaml.safe_load(patch["patch"]):
            _add(document, operation)
    for image in kustomization.get("images", []):
        for container in _containers(documents):
            if container["image"].split(":")[0] == image["name"]:
                container["image"] = f"{image.get('newName', image['name'])}:{image['newTag']}"
    return documents


def _containers(documents: list[dict[str, Any]]) -> list[dict[str, Any]]:
    pod_specs = [
        d["spec"]["template"]["spec"] for d in documents if d["kind"] in ("Deployment", "StatefulSet")
    ]
    return [c for spec in pod_specs for c in spec.get("containers", []) + spec.get("initContainers", [])]


def _add(document: dict[str, Any], operation: dict[str, Any]) -> None:
    """RFC 6902 `add`: `path` is a JSON pointer to a new member, or to a list's index or end (`-`)."""
    if operation["op"] != "add":
        raise ValueError(f"patch op {operation['op']!r} is not rendered by this helper")
    *parents, last = [part.replace("~1", "/").replace("~0", "~") for part in operation["path"].split("/")[1:]]
    node: Any = document
    for part in parents:
        node = node[int(part)] if isinstance(node, list) else node[part]
    if isinstance(node, list):
        node.insert(len(node) if last == "-" else int(last), operation["value"])
    else:
        node[last] = operation["value"]
