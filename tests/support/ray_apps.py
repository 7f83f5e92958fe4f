"""The Ray Serve applications the Ray suite and bench.ray_drain deploy, by import path.

Deployed from a config (`ServeDeploySchema`), not `serve.run`: a deployment's code version then
comes from the import path, so a new `num_replicas` scales the running replicas in place, and only
new `args` replace them. Ray's workers import this module: the scenario puts the repository on
their PYTHONPATH.
"""

from __future__ import annotations

import os
from typing import Any

from ray import serve
from ray.serve.handle import DeploymentHandle
from starlette.requests import Request

# No CPU reserved, so that a 1-CPU Ray runs every replica; a replica told to stop goes in a second.
OPTIONS: dict[str, Any] = {
    "ray_actor_options": {"num_cpus": 0},
    "graceful_shutdown_timeout_s": 1,
    "graceful_shutdown_wait_loop_s": 0.2,
}


@serve.deployment(**OPTIONS)
class Word:
    def __call__(self) -> str:
        return "hello"


@serve.deployment(num_replicas=2, **OPTIONS)
class Ingress:
    """The app's ingress: HAProxy routes to its replicas; each answer names the replica's PID."""

    def __init__(self, word: DeploymentHandle, tag: str) -> None:
        self.word = word
        self.tag = tag

    async def __call__(self, request: Request) -> str:
        return f"{self.tag} {await self.word.remote()} {os.getpid()}"


@serve.deployment(**OPTIONS)
class Echo:
    """A one-deployment app, for the two-node bench."""

    def __init__(self, tag: str) -> None:
        self.tag = tag

    def __call__(self, request: Request) -> str:
        return f"{self.tag} {os.getpid()}"


def two_deployments(args: dict[str, str]) -> serve.Application:
    return Ingress.bind(Word.bind(), args.get("tag", "v1"))


def one_deployment(args: dict[str, str]) -> serve.Application:
    return Echo.bind(args.get("tag", "v1"))
