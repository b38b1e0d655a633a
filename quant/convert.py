"""Model surgery: which Dense/Embed modules become int8 (rules on paths), and the swap itself.

A *plan* is the JSON-serialisable description of a quantised model: for each selected module
path, how its product is computed. The plan plus the float model's shapes are enough to rebuild
the quantised model's structure (`build_abstract`), which is how a checkpoint is read back.

Paths are the module paths of `DecoderLM` joined by "/": "blocks/attn/q", "blocks/mlp/down",
"head", "embed". Rules are fnmatch patterns; the default selects every Dense of the blocks.

`QuantConfig` and the mode table live in the JAX-free `quant.modes` (launchers check their flags
before JAX starts) and are imported from here too.
"""

from __future__ import annotations

import fnmatch
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from model.layers import Dense, Embed
from quant import quantizers as qz
from quant.dense import QuantDense, QuantEmbed
from quant.modes import ALL_MODES, DEFAULT_RULES, MODES, QuantConfig, QuantError  # noqa: F401
from quant.rotation import rotate_kernel


def module_path(path: tuple) -> str:
    return "/".join(str(k) for k in path)


def linear_modules(model: nnx.Module) -> dict[str, nnx.Module]:
    """Every Dense and Embed of the model by path (the candidates for quantisation)."""
    return {module_path(p): n for p, n in nnx.iter_graph(model) if isinstance(n, (Dense, Embed))}


def get_module(model: nnx.Module, path: str) -> nnx.Module:
    node = model
    for key in path.split("/"):
        node = getattr(node, key)
    return node


def set_module(model: nnx.Module, path: str, new: nnx.Module) -> None:
    *parents, last = path.split("/")
    setattr(get_module(model, "/".join(parents)) if parents else model, last, new)


def make_plan(qcfg: QuantConfig, model: nnx.Module) -> dict:
    """{path: {"kind", "act", "outlier_threshold", "outlier_capacity", "float_layers", "rotate"
    [, "rotation_seed"]}} for the selected modules (capacity: how many input columns may take
    the float path; rotate: the int8 product takes rotated inputs, `quant/rotation.py`); an
    embedding's entry is {"kind", "act", "block", "scale_dtype"}."""
    qcfg.validate()
    candidates = linear_modules(model)
    # every layer, selected or not: smoothing scales kernels the rules do not select
    stored = sorted(p for p, m in candidates.items() if isinstance(m, Dense) and m.out_in)
    if stored:
        raise QuantError(f"{stored[0]}: its kernel is stored for decoding ([out, in], "
                         f"model.layers.use_native_float); quantise the model before that")
    selected = sorted(p for p in candidates if any(fnmatch.fnmatch(p, r) for r in qcfg.rules))
    if not selected:
        raise QuantError(f"rules={list(qcfg.rules)}: select no module; candidates: "
                         f"{', '.join(sorted(candidates))}")
    plan = {}
    for path in selected:
        if isinstance(candidates[path], Embed):
            width = candidates[path].embedding.shape[-1]
            # Block scales where the width holds whole blocks; else one scale per row.
            block = qcfg.embed_block if qcfg.embed_block and width % qcfg.embed_block == 0 \
                else None
            if block:
                _check_half_scales(path, candidates[path].embedding[...])
            # Block scales are stored in float16, as GGUF Q8_0 stores them; per-row scales are
            # the tied head's per-channel scales, which the integer product takes in float32.
            plan[path] = {"kind": "embed", "act": qcfg.act, "block": block,
                          "scale_dtype": "float16" if block else "float32"}
            continue
        in_features = candidates[path].kernel.shape[-2]
        plan[path] = {"kind": "dense", "act": qcfg.act, "float_layers": [],
                      "outlier_threshold": qcfg.outlier_threshold if qcfg.outliers else None,
                      "outlier_capacity": (max(1, math.ceil(qcfg.outlier_capacity * in_features))
                                           if qcfg.outliers else None),
                      "rotate": qcfg.rotate}
        if qcfg.rotate:
            plan[path]["rotation_seed"] = qcfg.rotation_seed
    return plan


def check_finite(tree, what: str) -> None:
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        if jnp.issubdtype(leaf.dtype, jnp.floating) and not bool(jnp.all(jnp.isfinite(leaf))):
            raise QuantError(f"{what} {jax.tree_util.keystr(path)}: holds non-finite values "
                             f"(NaN or inf); refusing to quantise it")


def _weight_scale(w: jax.Array, qcfg: QuantConfig) -> jax.Array:
    if qcfg.clip_search:
        return qz.clipped_weight_scale(w, qcfg.weights)
    return qz.weight_scale(w, qcfg.weights)


def quantize_dense(dense: Dense, entry: dict, qcfg: QuantConfig,
                   act_absmax: jax.Array | None = None) -> QuantDense:
    """The int8 twin of one (possibly stacked) Dense under its plan entry.

    act_absmax: calibrated per-layer absmax of the input ([layers] or []), for act="static".
    """
    w = dense.kernel[...]
    if not jnp.issubdtype(w.dtype, jnp.floating):
        raise QuantError(f"kernel dtype {w.dtype}: only float kernels (float32, bfloat16) can be "
                         f"quantised")
    axes = tuple(dense.kernel.get_metadata()["out_sharding"])
    lead = w.shape[:-2]
    # Plans written before rotation have neither key. The int8 kernel is Rᵀ W; the bf16 copy
    # kept for `auto`'s float layers stays W (the float path multiplies the unrotated input).
    rotate = bool(entry.get("rotate", False))
    seed = int(entry.get("rotation_seed", 0))
    w_int = rotate_kernel(w, seed) if rotate else w
    scale = _weight_scale(w_int, qcfg)
    act_scale = None
    if entry["act"] == "static":
        act_scale = (qz.scale_from_absmax(act_absmax) if act_absmax is not None
                     else jnp.ones(lead, jnp.float32))
    kernel_float = keep_float = None
    if entry["float_layers"]:
        keep = np.zeros(lead, np.int8)
        keep.reshape(-1)[np.asarray(entry["float_layers"], np.int64)] = 1
        # Kept layers run on a bf16 copy of the kernel. The layer scan slices every stacked
        # parameter, so the copy has all layers (a module with any kept layer pays 2 more bytes
        # per parameter; `param_bytes` counts them).
        kernel_float, keep_float = w.astype(jnp.bfloat16), jnp.asarray(keep)
    bias = dense.bias[...] if dense.bias is not None else None
    # Quantised in the float layout [.., in, out] (one scale per output column), stored
    # [.., out, in] (quant/dense.py says why).
    kernel_q = jnp.swapaxes(qz.quantize(w_int, scale), -1, -2)
    return QuantDense(kernel_q, scale, kernel_axes=axes,
                      compute_dtype=dense.compute_dtype, act=entry["act"], act_scale=act_scale,
                      outlier_threshold=entry["outlier_threshold"],
                      outlier_capacity=entry.get("outlier_capacity"), kernel_float=kernel_float,
                      keep_float=keep_float, bias=bias, rotate=rotate, rotation_seed=seed)


def _check_half_scales(path: str, table: jax.Array) -> None:
    """QuantError where a block scale of `table` would not fit float16 (checked on a concrete
    table; an abstract one, as a checkpoint's structure is rebuilt, has nothing to check)."""
    if isinstance(table, jax.core.Tracer) or not isinstance(table, jax.Array | np.ndarray):
        return
    absmax = float(jnp.max(jnp.abs(table.astype(jnp.float32))))
    if absmax * qz.INV_QMAX > qz.HALF_MAX:
        raise QuantError(f"{path}: a value of {absmax:.3g} needs a block scale above float16's "
                         f"{qz.HALF_MAX:g}; use embed_block=0 (one float32 scale per row)")


def quantize_embed(embed: Embed, act: str = "token", block: int | None = None,
                   scale_dtype: str = "float32") -> QuantEmbed:
    """The int8 table with one scale per `block` values of a row (None: per row, per token id),
    the scales stored in `scale_dtype` ("float16": `quantizers.half_scale`, the values
    quantised under the stored scales). `act` matters only for a per-row table's tied head
    (`QuantEmbed.attend`): per-token int8 activations, or "none" (weight-only); a static scale
    is not calibrated for the head, so it is per token. A block-scaled table's head is
    weight-only."""
    table = embed.embedding[...]
    scale = qz.block_scale(table, block or table.shape[-1])  # [vocab, blocks] (per row: 1)
    if scale_dtype == "float16":
        scale = qz.half_scale(scale)
    elif scale_dtype != "float32":
        raise QuantError(f"scale_dtype={scale_dtype!r}: must be 'float32' or 'float16'")
    return QuantEmbed(qz.quantize_blocks(table, scale), scale,
                      axes=tuple(embed.embedding.get_metadata()["out_sharding"]),
                      compute_dtype=embed.compute_dtype,
                      act="none" if act == "none" else "token", block=block)


def apply_plan(model: nnx.Module, plan: dict, qcfg: QuantConfig,
               act_absmax: dict[str, jax.Array] | None = None) -> nnx.Module:
    """Swap the planned modules for their int8 twins, in place; returns the model."""
    act_absmax = act_absmax or {}
    for path, entry in plan.items():
        module = get_module(model, path)
        if entry["kind"] == "embed":
            # Plans written before block scales have no "block": one scale per row; before
            # float16 block scales, no "scale_dtype": float32.
            set_module(model, path, quantize_embed(module, entry.get("act", "token"),
                                                   entry.get("block"),
                                                   entry.get("scale_dtype", "float32")))
        else:
            set_module(model, path, quantize_dense(module, entry, qcfg, act_absmax.get(path)))
    return model


def build_abstract(model_fn, plan: dict, qcfg: QuantConfig):
    """(graphdef, abstract state) of the quantised model, without computing anything."""
    return nnx.split(nnx.eval_shape(lambda: apply_plan(model_fn(), plan, qcfg)))


def quantized_fraction(params_float: dict, plan: dict) -> float:
    """Share of the float model's parameters (by count) whose product runs in int8 (layers kept
    in bf16 by `auto` do not count; `param_bytes` says what is stored)."""
    total = sum(x.size for x in jax.tree.leaves(params_float))
    n = 0
    for path, entry in plan.items():
        node = params_float
        for key in path.split("/"):
            node = node[key]
        leaf = node["embedding"] if entry["kind"] == "embed" else node["kernel"]
        per_layer = leaf.size // max(1, int(np.prod(leaf.shape[:-2]))) if leaf.ndim > 2 \
            else leaf.size
        n += leaf.size - per_layer * len(entry.get("float_layers", []))
    return n / total
