"""shardq's own int8 product for a few rows on the CPU (`native/int8_matvec.cc`), through XLA's FFI.

Batch-1 decoding multiplies one row of activations by every kernel. XLA:CPU has no int8 kernel
for one row (`quant.dense.MIN_INT8_ROWS`); this one quantises the row, multiplies it by the int8
kernel with the CPU's byte dot products over XLA's own intra-op threads, and dequantises, in one
call, with the same arithmetic as `quant.dense.token_product` (per-token scales): the same
float32 product, bit for bit. (Inside a model XLA's own program may fuse the dequantisation
with the add that follows into one rounding, which a separate call cannot: the two programs'
activations then differ in the last bit.) A second entry serves weight-only products (w8):
float rows times the int8 kernel converted in registers, equal to XLA's to float32 rounding.
Each has a grouped twin that multiplies the same rows by several kernels in one call (an
attention's q, k and v): one quantisation of the rows, one share-out of every kernel's outputs
over the threads, each kernel's result the one its own call gives, bit for bit.

The source is compiled for this CPU (`-march=native`) the first time a program needs it, into
a cache folder keyed by the source, the compiler, the CPU's flags and jaxlib's version
($SHARDQ_CACHE_DIR, else ~/.cache/shardq). Where there is no C++ compiler, or the build fails,
`status()` says why and every product stays XLA's; `SHARDQ_INT8_KERNEL=off` turns it off.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shlex
import shutil
import subprocess
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp

SOURCE = Path(__file__).with_name("native") / "int8_matvec.cc"
TARGET = "shardq_int8_matvec"  # per-token int8 activations (w8a8)
TARGET_W8 = "shardq_w8_matvec"  # float activations (weight-only w8)
# One call for several kernels that multiply the same rows (an attention's q, k and v): the rows
# are quantised once, and the threads share out all the kernels' outputs at once.
TARGET_GROUP = "shardq_int8_matvec_group"
TARGET_W8_GROUP = "shardq_w8_matvec_group"
TARGETS = (TARGET, TARGET_W8, TARGET_GROUP, TARGET_W8_GROUP)
# Up to this many rows a product runs here; more rows are a GEMM, which XLA's (YNNPACK's) is
# built for.
MAX_ROWS = 8
# -ffp-contract=off: no multiply-add contracted into one rounding, which would part the
# kernel's arithmetic from the reference's.
FLAGS = ("-O3", "-march=native", "-std=c++17", "-shared", "-fPIC", "-fno-math-errno",
         "-ffp-contract=off")
ENV_SWITCH = "SHARDQ_INT8_KERNEL"


def _compiler() -> list[str] | None:
    """The C++ compiler's command ($CXX, which may hold arguments: "ccache g++"), else the first
    of g++, c++ and clang++ found."""
    if os.environ.get("CXX"):
        return shlex.split(os.environ["CXX"])
    found = next((c for c in ("g++", "c++", "clang++") if shutil.which(c)), None)
    return [found] if found else None


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor()


def cache_dir() -> Path:
    root = os.environ.get("SHARDQ_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "shardq")
    return Path(root) / "native"


def _build(cxx: list[str]) -> Path:
    """The compiled library for this CPU, built once (a cached copy is reused)."""
    import jaxlib

    include = jax.ffi.include_dir()
    key = hashlib.sha256("\0".join(
        [SOURCE.read_text(), " ".join(cxx), " ".join(FLAGS), _cpu_flags(), jaxlib.__version__,
         include]
    ).encode()).hexdigest()[:16]
    out = cache_dir() / f"int8_matvec-{key}.so"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    # Built beside its final name, then renamed: a concurrent process sees all of it or none.
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    try:
        done = subprocess.run([*cxx, *FLAGS, f"-I{include}", str(SOURCE), "-o", tmp],
                              capture_output=True, text=True, timeout=300)
        if done.returncode != 0:
            lines = [ln for ln in done.stderr.splitlines() if "error" in ln] or [""]
            raise RuntimeError(f"{' '.join(cxx)} failed: {lines[0].strip()[:200]}")
        os.chmod(tmp, 0o755)  # mkstemp's 0600 would shut out other users of a shared cache
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    return out


@functools.cache
def status() -> dict:
    """{"available": bool, "isa": the instruction set built for, "library": path,
    "reason": why not}; builds and registers the kernel on the first call."""
    if os.environ.get(ENV_SWITCH, "").lower() in ("0", "off", "false", "no"):
        return {"available": False, "reason": f"${ENV_SWITCH} is off"}
    cxx = _compiler()
    if cxx is None:
        return {"available": False, "reason": "no C++ compiler (g++, c++, clang++ or $CXX)"}
    try:
        path = _build(cxx)
        lib = ctypes.cdll.LoadLibrary(str(path))
        lib.ShardqInt8MatvecIsa.restype = ctypes.c_char_p
        jax.ffi.register_ffi_target(TARGET, jax.ffi.pycapsule(lib.ShardqInt8Matvec),
                                    platform="cpu")
        jax.ffi.register_ffi_target(TARGET_W8, jax.ffi.pycapsule(lib.ShardqWeightInt8Matvec),
                                    platform="cpu")
        jax.ffi.register_ffi_target(TARGET_GROUP, jax.ffi.pycapsule(lib.ShardqInt8MatvecGroup),
                                    platform="cpu")
        jax.ffi.register_ffi_target(TARGET_W8_GROUP,
                                    jax.ffi.pycapsule(lib.ShardqWeightInt8MatvecGroup),
                                    platform="cpu")
    except (OSError, RuntimeError, AttributeError, subprocess.SubprocessError) as e:
        return {"available": False, "reason": str(e).splitlines()[0] if str(e) else repr(e)}
    _keep.append(lib)
    return {"available": True, "isa": lib.ShardqInt8MatvecIsa().decode(), "library": str(path),
            "compiler": " ".join(cxx)}


_keep: list = []  # the loaded library lives as long as the process


def usable(rows: int) -> bool:
    """Whether a product of `rows` rows runs here (the kernel builds, and the rows are few)."""
    return rows <= MAX_ROWS and status()["available"]


def _call(target: str, x: jax.Array, kernels: list[tuple[jax.Array, jax.Array]]
          ) -> list[jax.Array]:
    if not status()["available"]:  # builds and registers the kernels on first use
        raise RuntimeError(f"the int8 kernel is not available: {status()['reason']}")
    outs = [jax.ShapeDtypeStruct((x.shape[0], w_q.shape[0]), jnp.float32) for w_q, _ in kernels]
    # vmapped, the call runs once per batch element (the kernel takes one [rows, in] input)
    call = jax.ffi.ffi_call(target, outs, vmap_method="sequential")
    # The weight-only entries read float16 scales as they are stored (an int8 table's blocks).
    keep = (jnp.float16,) if target in (TARGET_W8, TARGET_W8_GROUP) else ()
    operands = [a for w_q, w_scale in kernels
                for a in (w_q, w_scale.reshape(-1).astype(
                    w_scale.dtype if w_scale.dtype in keep else jnp.float32))]
    return list(call(x.astype(jnp.float32), *operands))


def product(x: jax.Array, w_q: jax.Array, w_scale: jax.Array) -> jax.Array:
    """x [rows, in] (float32) times the int8 kernel w_q [out, in] with per-token int8
    activations -> float32 [rows, out]; w_scale holds out (or 1) float32 scales. CPU only: a
    caller that may run elsewhere puts it in one branch of `jax.lax.platform_dependent`."""
    return _call(TARGET, x, [(w_q, w_scale)])[0]


def product_weight_only(x: jax.Array, w_q: jax.Array, w_scale: jax.Array) -> jax.Array:
    """x [rows, in] (float32) times the int8 kernel w_q [out, in], each weight converted to
    float32 in the call (weight-only w8) -> float32 [rows, out], scaled by w_scale (float32,
    or float16 as an int8 table's block scales are stored). Equal to XLA's product to float32
    rounding (its sums run in another order). CPU only."""
    return _call(TARGET_W8, x, [(w_q, w_scale)])[0]


def product_group(x: jax.Array, kernels: list[tuple[jax.Array, jax.Array]]) -> list[jax.Array]:
    """`product(x, w_q, w_scale)` for every (w_q, w_scale) of `kernels`, in one call: the same
    results, bit for bit. CPU only."""
    return _call(TARGET_GROUP, x, kernels)


def product_weight_only_group(x: jax.Array, kernels: list[tuple[jax.Array, jax.Array]]
                              ) -> list[jax.Array]:
    """`product_weight_only(x, w_q, w_scale)` for every kernel, in one call: the same results,
    bit for bit. CPU only."""
    return _call(TARGET_W8_GROUP, x, kernels)
