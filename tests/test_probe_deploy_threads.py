"""deploy/k8s/base: the engine core's torch threads fit the CPUs the pod requests. Without --num-threads the
core sizes its pool by the physical cores of its CPU affinity (sluice.engine.process.threads), and a pod
with a CPU request and no CPU limit may run on every core of the node: one pool per GPU pod, each as large
as the node, contending for the CPUs the scheduler gave to the others."""

from __future__ import annotations

import os
from fractions import Fraction

from deploy_facts import parse_sluice_args
from kustomize_render import render
from toolchains import REPO

K8S_DIR = os.path.join(REPO, "deploy", "k8s", "base")


def cpus(quantity: str | int) -> Fraction:
    """A Kubernetes CPU quantity ("4", "500m", 2) in CPUs."""
    text = str(quantity)
    return Fraction(text[:-1]) / 1000 if text.endswith("m") else Fraction(text)


def test_cpu_quantities() -> None:
    assert (cpus("4"), cpus("500m"), cpus(2), cpus("1.5")) == (4, Fraction(1, 2), 2, Fraction(3, 2))


def test_the_engine_threads_fit_the_requested_cpus() -> None:
    (deployment,) = [doc for doc in render(K8S_DIR) if doc["kind"] == "Deployment"]
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    args = parse_sluice_args(container["args"])
    resources = container["resources"]
    assert args.num_threads is not None, "the pool would be sized by the node's cores"
    assert 1 <= args.num_threads <= cpus(resources["requests"]["cpu"])
