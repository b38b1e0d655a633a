"""Running a stack of layers whose parameters are stacked on a leading `layers` axis.

Every model in `model/` runs its blocks through one protocol, a *runner*:

    runner(run_layer, stacked_params, x, aux) -> x

where `run_layer(layer_params, x, aux) -> x` applies one block and `aux` is whatever every
layer needs besides its input (positions for the decoder, the padding mask for the encoder).
The default runner is `scan_layers` (one `lax.scan`, optionally rematerialised). Other packages
pass their own without the model knowing why: `parallel/` gathers each layer's shards right
before it runs (ZeRO-3, gather-then-release), `quant/` runs layers eagerly to record their
inputs.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
from jax import lax

from model.config import REMAT_NAMES

RunLayer = Callable[[Any, jax.Array, Any], jax.Array]
Runner = Callable[[RunLayer, Any, jax.Array, Any], jax.Array]

# Named rematerialisation policies of the layer body (what the backward pass may keep), one per
# allowed value of ModelConfig.remat.
REMAT_POLICIES: dict[str, Callable | None] = dict(zip(REMAT_NAMES, (
    None,  # none
    jax.checkpoint_policies.nothing_saveable,  # full
    jax.checkpoint_policies.dots_with_no_batch_dims_saveable,  # save_dots
), strict=True))


def n_layers(stacked) -> int:
    return jax.tree.leaves(stacked)[0].shape[0]


def scan_layers(run_layer: RunLayer, stacked, x: jax.Array, aux, *,
                policy: Callable | None = None, unroll: int = 1) -> jax.Array:
    """The default runner: one scan over the stacked layers, `policy` deciding what the
    backward pass keeps of each layer (None: everything)."""

    def body(x, layer_params):
        return run_layer(layer_params, x, aux), None

    if policy is not None:
        body = jax.checkpoint(body, policy=policy, prevent_cse=False)
    x, _ = lax.scan(body, x, stacked, unroll=min(unroll, n_layers(stacked)))
    return x


def default_runner(remat: str = "none", unroll: int = 1) -> Runner:
    """`scan_layers` with a named remat policy (see REMAT_POLICIES)."""
    return functools.partial(scan_layers, policy=REMAT_POLICIES[remat], unroll=unroll)
