"""Python client for the Sluice inference service (sluice.v1.InferenceService)."""

from sluice.client import AsyncClient, Client, Completion, SluiceError, generate_request

__all__ = ["AsyncClient", "Client", "Completion", "SluiceError", "generate_request"]
