"""Device mesh construction: ("data", "fsdp") over the available devices."""

from __future__ import annotations

import re

import jax
import numpy as np
from jax.sharding import Mesh

MESH_AXES = ("data", "fsdp")


def parse_mesh(spec: str | None, n_devices: int) -> dict[str, int]:
    """'data=2,fsdp=4' -> {'data': 2, 'fsdp': 4}; None -> all devices on fsdp. Raises ValueError
    naming `mesh` for an unknown or repeated axis, a size that is not a positive integer, or
    sizes whose product is not the device count."""
    if not spec:
        return {"data": 1, "fsdp": n_devices}
    sizes = {"data": 1, "fsdp": 1}
    seen = set()
    for part in spec.split(","):
        name, _, value = part.partition("=")
        name, value = name.strip(), value.strip()
        # ASCII digits only: str.isdigit() also accepts characters such as '²' that int() refuses.
        if name not in MESH_AXES or not re.fullmatch(r"[0-9]+", value) or int(value) < 1:
            raise ValueError(f"mesh={spec!r}: expected comma-separated data=A,fsdp=B with "
                             f"positive integers")
        if name in seen:  # a repeated axis would silently keep only its last size
            raise ValueError(f"mesh={spec!r}: axis {name!r} given twice; each of "
                             f"{', '.join(MESH_AXES)} at most once")
        seen.add(name)
        sizes[name] = int(value)
    if sizes["data"] * sizes["fsdp"] != n_devices:
        raise ValueError(f"mesh={spec!r}: data*fsdp={sizes['data'] * sizes['fsdp']} must equal "
                         f"the device count {n_devices}")
    return sizes


def make_mesh(n_devices: int | None = None, spec: str | None = None) -> Mesh:
    available = jax.devices()
    n = n_devices or len(available)
    if n > len(available):
        raise ValueError(f"devices={n}: only {len(available)} available "
                         f"({available[0].platform}); on CPU pass --devices before JAX starts")
    sizes = parse_mesh(spec, n)
    devices = np.asarray(available[:n]).reshape(sizes["data"], sizes["fsdp"])
    return Mesh(devices, MESH_AXES)
