"""The int8 checkpoint layout (Orbax), readable straight onto a sharded mesh.

  WORKDIR/quant/MODE/
    ckpt/params/   Orbax StandardSave of the quantised parameters, a pure dict by module path:
                   QuantDense: kernel_q int8 [layers, out, in] (before format /4
                   [layers, in, out]: transposed on reading), kernel_scale float32
                   [layers, out] (per tensor: [layers, 1]), act_scale float32 [layers] (static
                   mode), kernel_float + keep_float (auto mode, layers kept in float);
                   (mode w8a8-rotated: kernel_q is the int8 Rᵀ W, `quant/rotation.py`);
                   QuantEmbed: embedding_q int8 [vocab, embed], block_scale float16
                   [vocab, embed / block] (format /5: float32; before /5, and with
                   embed_block=0: row_scale float32 [vocab]);
                   everything else (norm scales, unquantised Dense) as in the float model.
    ckpt/meta/     Orbax JSON: format, quantisation config, plan (per module: activation mode,
                   outlier threshold and capacity, float layers, rotation), model config,
                   source step, calibration data (sampler seed, start position, batches x
                   batch size).
    report.json    per-layer error report (also written by experiments.quantize).

The quantised model's structure is rebuilt from the model config and the plan; the reader's
shardings come from the logical axes each parameter carries, so int8 kernels load sharded like
zero3 parameters (their `embed` dimension over mesh axis `fsdp`).
"""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp
from flax import nnx
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from model import DecoderLM, ModelConfig
from model.config import differing_fields
from parallel.state import logical_shardings, logical_specs
from quant.convert import QuantConfig, QuantError, build_abstract, check_finite

# /2 added the outlier capacity to the plan and made kept layers' kernels bf16. A /1 plan has no
# capacity, so its outlier split runs uncapped, as it was written. /3 added `rotate` and
# `rotation_seed` to the plan (its kernels hold Rᵀ W: a reader that ignored them would compute
# garbage, so /2 readers must refuse it); a plan without them is unrotated. /4 stores the int8
# kernels [.., out, in] (quant/dense.py says why); older files hold them [.., in, out] and are
# read in that layout, then transposed: the same products, bit for bit. /5 adds block scales
# to an int8 embedding table (`block` in its plan entry, `block_scale` beside `embedding_q`),
# which a /4 reader would not build: a plan entry without `block` has one scale per row. /6
# stores block scales in float16 (`scale_dtype` in the plan entry), which a /5 reader would
# build as float32: an entry without `scale_dtype` holds float32 scales.
FORMAT = "shardq-int8/6"
KERNELS_IN_OUT = ("shardq-int8/1", "shardq-int8/2", "shardq-int8/3")
READABLE = (*KERNELS_IN_OUT, "shardq-int8/4", "shardq-int8/5", FORMAT)


def quant_dir(workdir: str | Path, mode: str) -> Path:
    return Path(workdir).absolute() / "quant" / mode


def save(path: str | Path, qparams: dict, meta: dict) -> None:
    """Write (replacing) the checkpoint at path/ckpt. Refuses NaNs before touching the disk."""
    check_finite(qparams, "quantised parameter")
    path = Path(path).absolute()
    path.mkdir(parents=True, exist_ok=True)
    with ocp.Checkpointer(ocp.CompositeCheckpointHandler()) as ckptr:
        ckptr.save(path / "ckpt", args=ocp.args.Composite(
            params=ocp.args.StandardSave(qparams),
            meta=ocp.args.JsonSave({"format": FORMAT, **meta})), force=True)


def read_meta(path: str | Path) -> dict:
    ckpt = Path(path).absolute() / "ckpt"
    if not ckpt.is_dir():
        raise QuantError(f"{str(path)!r}: holds no quantised checkpoint; run experiments.quantize")
    with ocp.Checkpointer(ocp.CompositeCheckpointHandler()) as ckptr:
        meta = ckptr.restore(ckpt, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
    if meta.get("format") not in READABLE:
        raise QuantError(f"{str(path)!r}: format {meta.get('format')!r}, readable: "
                         f"{', '.join(READABLE)}")
    return meta


def load(path: str | Path, model_cfg: ModelConfig, mesh: Mesh | None = None,
         sharded: bool = True):
    """(quantised graphdef, params, meta). With a mesh, params land sharded (or replicated)."""
    meta = read_meta(path)
    diff = model_differences(meta["model"], model_cfg)
    if diff:
        raise QuantError(f"{str(path)!r}: written for a different model ({'; '.join(diff)}); "
                         f"quantise this run again")
    qcfg = QuantConfig.from_json(meta["quant_config"])
    graphdef, abstract = build_abstract(lambda: DecoderLM(model_cfg, rngs=nnx.Rngs(0)),
                                        meta["plan"], qcfg)
    specs = logical_specs(abstract)
    shapes = nnx.to_pure_dict(abstract)
    in_out = meta["format"] in KERNELS_IN_OUT
    # What the file holds: an older file's int8 kernels in the float layout, sharded alike.
    file_shapes = _kernels_swapped(shapes, lambda a: jax.ShapeDtypeStruct(
        _last_two_swapped(a.shape), a.dtype)) if in_out else shapes
    file_specs = _kernels_swapped(specs, lambda p: P(*_last_two_swapped(p))) if in_out else specs
    if mesh is not None:
        target = jax.tree.map(
            lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
            file_shapes, logical_shardings(file_specs, mesh, sharded))
    else:
        target = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), file_shapes)
    try:
        with ocp.Checkpointer(ocp.CompositeCheckpointHandler()) as ckptr:
            params = ckptr.restore(Path(path).absolute() / "ckpt", args=ocp.args.Composite(
                params=ocp.args.StandardRestore(target)))["params"]
    except (ValueError, KeyError, TypeError) as e:
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise QuantError(f"{str(path)!r}: does not match the model ({first[:200]})") from None
    if in_out:
        params = _kernels_swapped(params, lambda a: jnp.swapaxes(a, -1, -2))
        if mesh is not None:
            params = jax.device_put(params, logical_shardings(specs, mesh, sharded))
    return graphdef, params, meta


def _last_two_swapped(dims: tuple) -> tuple:
    return (*dims[:-2], dims[-1], dims[-2])


def _kernels_swapped(tree: dict, fn) -> dict:
    """`tree` (parameters, shapes or logical specs) with `fn` applied to every QuantDense int8
    kernel (the leaves named kernel_q)."""
    return jax.tree_util.tree_map_with_path(
        lambda path, x: fn(x) if getattr(path[-1], "key", None) == "kernel_q" else x, tree,
        is_leaf=lambda x: isinstance(x, P))


def model_differences(written: dict, cfg: ModelConfig) -> list[str]:
    """What makes the model a checkpoint was written for another than `cfg`, one phrase per
    field ("d_model: 64 in the file, 32 here"; which fields count: `differing_fields`)."""
    defaults = {f.name: f.default for f in dataclasses.fields(ModelConfig)}
    return [f"{key}: {written.get(key, defaults.get(key))!r} in the file, "
            f"{repr(getattr(cfg, key)) if key in defaults else 'no such field'} here"
            for key in differing_fields(written, cfg)]


def disk_bytes(path: str | Path) -> int:
    return sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file())


def save_float_reference(path: str | Path, params: dict) -> int:
    """Write the float params in the same Orbax layout and return its size on disk (bytes)."""
    path = Path(path).absolute()
    shutil.rmtree(path, ignore_errors=True)
    with ocp.Checkpointer(ocp.CompositeCheckpointHandler()) as ckptr:
        ckptr.save(path, args=ocp.args.Composite(params=ocp.args.StandardSave(params)))
    return disk_bytes(path)
