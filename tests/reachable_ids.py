"""The leak check of the engine tests: which request ids an engine still reaches after its requests ended."""

from __future__ import annotations

import collections

import torch


def ids_held(root: object, request_ids: set[str]) -> list[str]:
    """Where, in the objects `root` reaches (attributes, dict keys and values, sequence items), a string
    names one of `request_ids` or a sample of one ("request-3#1"): per-request state that was never freed.
    Tensors and modules are not opened (per-request state lives in Sluice's own objects)."""
    held, seen, stack = [], set(), [(root, "engine")]
    while stack:
        obj, path = stack.pop()
        if isinstance(obj, str):
            if obj.split("#")[0] in request_ids:
                held.append(path)
            continue
        if id(obj) in seen or isinstance(obj, (bytes, int, float, torch.Tensor, torch.nn.Module)):
            continue
        seen.add(id(obj))
        if isinstance(obj, dict):
            stack += [(k, f"{path} key") for k in obj] + [(v, f"{path}[{k!r}]") for k, v in obj.items()]
        elif isinstance(obj, (list, tuple, set, frozenset, collections.deque)):
            stack += [(item, f"{path}[*]") for item in obj]
        elif not isinstance(obj, type) and type(obj).__module__.startswith("sluice"):
            attributes = getattr(obj, "__dict__", None) or {
                name: getattr(obj, name) for name in getattr(obj, "__slots__", ()) if hasattr(obj, name)
            }
            stack += [(v, f"{path}.{k}") for k, v in attributes.items()]
    return held
