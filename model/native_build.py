"""Building and loading shardq's native CPU kernels (C++ sources called through XLA's FFI).

A kernel's source is compiled for this CPU (`-march=native`) the first time a program needs it,
into a cache folder keyed by the source, the compiler, the CPU's flags and jaxlib's version
($SHARDQ_CACHE_DIR, else ~/.cache/shardq), and its entries are registered as XLA custom call
targets on the CPU. Where there is no C++ compiler, or the build fails, `load` says why and the
caller keeps XLA's own operations. `quant.native_int8` (int8 products), `model.native_float`
(float32 products) and `model.native_attention` (attention over a KV cache) are built this
way.
"""

from __future__ import annotations

import ctypes
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

# -ffp-contract=off: no multiply-add contracted into one rounding where the source did not ask
# for one, which would part a kernel's arithmetic from the reference's.
FLAGS = ("-O3", "-march=native", "-std=c++17", "-shared", "-fPIC", "-fno-math-errno",
         "-ffp-contract=off")
OFF = ("0", "off", "false", "no")
# The headers every kernel may include (share_out.h: a call's work over XLA's threads).
HEADERS = Path(__file__).with_name("native")

_loaded: list = []  # every loaded library lives as long as the process


def compiler() -> list[str] | None:
    """The C++ compiler's command ($CXX, which may hold arguments: "ccache g++"), else the first
    of g++, c++ and clang++ found."""
    if os.environ.get("CXX"):
        return shlex.split(os.environ["CXX"])
    found = next((c for c in ("g++", "c++", "clang++") if shutil.which(c)), None)
    return [found] if found else None


def cpu_flags() -> str:
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


def build(source: Path, cxx: list[str]) -> Path:
    """The compiled library of `source` for this CPU, built once (a cached copy is reused; the
    key covers `HEADERS` too)."""
    import jaxlib

    include = jax.ffi.include_dir()
    headers = [h.read_text() for h in sorted(HEADERS.glob("*.h"))]
    key = hashlib.sha256("\0".join(
        [source.read_text(), *headers, " ".join(cxx), " ".join(FLAGS), cpu_flags(),
         jaxlib.__version__, include]
    ).encode()).hexdigest()[:16]
    out = cache_dir() / f"{source.stem}-{key}.so"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    # Built beside its final name, then renamed: a concurrent process sees all of it or none.
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    try:
        done = subprocess.run([*cxx, *FLAGS, f"-I{include}", f"-I{HEADERS}", str(source),
                               "-o", tmp],
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


def load(source: Path, targets: dict[str, str], switch: str
         ) -> tuple[ctypes.CDLL | None, dict]:
    """Build `source`, load it and register each {custom call target: exported symbol} on the
    CPU. Returns (the library, {"available": True, "library", "compiler"}), or (None,
    {"available": False, "reason"}) where $`switch` is off, no compiler is found or the build
    fails."""
    if os.environ.get(switch, "").lower() in OFF:
        return None, {"available": False, "reason": f"${switch} is off"}
    cxx = compiler()
    if cxx is None:
        return None, {"available": False, "reason": "no C++ compiler (g++, c++, clang++ or $CXX)"}
    try:
        path = build(source, cxx)
        lib = ctypes.cdll.LoadLibrary(str(path))
        for target, symbol in targets.items():
            jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(lib, symbol)),
                                        platform="cpu")
    except (OSError, RuntimeError, AttributeError, subprocess.SubprocessError) as e:
        return None, {"available": False,
                      "reason": str(e).splitlines()[0] if str(e) else repr(e)}
    _loaded.append(lib)
    return lib, {"available": True, "library": str(path), "compiler": " ".join(cxx)}


def last_axis_call(target: str, x: jax.Array, out_dtype, xla, status: dict) -> jax.Array:
    """A reduction of x's last axis (one value per row): the kernel registered as `target` on a
    CPU, `xla(x)` elsewhere, and everywhere where the kernel is not available (`status`), the
    axis is empty or x is not float32 or narrower. The kernel reads float32 and has no gradient
    (its result is a constant to differentiation)."""
    if x.shape[-1] == 0 or x.dtype not in (jnp.float32, jnp.bfloat16, jnp.float16) \
            or not status["available"]:
        return xla(x)

    def kernel(x):
        call = jax.ffi.ffi_call(target, jax.ShapeDtypeStruct(x.shape[:-1], out_dtype),
                                vmap_method="broadcast_all")
        return call(jax.lax.stop_gradient(x).astype(jnp.float32))

    return jax.lax.platform_dependent(x, cpu=kernel, default=xla)
