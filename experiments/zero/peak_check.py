"""The planner's compiled peak against the peak a real step reaches on this machine.

XLA:CPU keeps no memory statistics (`device.memory_stats()` is None), so the executed peak is
read from the process's anonymous resident memory (RssAnon in Linux /proc/self/status: heap and
mmapped buffers, not the shared libraries' code pages): one fresh process per configuration,
with glibc told to serve every allocation of 128 KiB or more by mmap and to give it back on
free (MALLOC_MMAP_THRESHOLD_, set by whoever starts the process), so that freed buffers leave
the resident set instead of being kept for reuse. Then, for N fake devices:

  inputs  = growth while the state and the batch are allocated (by an already compiled program
            with no temporaries);
  step    = the largest value sampled (every millisecond) during the first step minus the value
            before it (a step allocates its temporaries when it starts and frees them when it
            ends);
  executed peak per device = (inputs + step) / N, the N devices' programs running at once.

The kernel's own high-water mark of the resident set (VmHWM, reset just before the step) is
read as a check on the sampling: it cannot miss a peak between two samples.

Beside the resident set, glibc's own count of the bytes it has handed out (mallinfo2) is
sampled at the same moments, split at the mmap threshold: the large blocks are XLA's arrays
and temporaries, what the compiled peak accounts for; the small ones are the runtime's own
(mostly the closures of work queued on the CPU thread pools), which no compiled peak holds.

It is compared with the compiled peak (argument + output + temp - alias) of the executable that
ran (default compiler options) and of the planner's compile (its code-generation options).
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import os
import re
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from experiments.training.config import TrainConfig
from experiments.training.optim import make_optimizer
from experiments.zero.plan_estimate import COMPILER_OPTIONS
from model.config import ModelConfig
from parallel import hlo
from parallel.mesh import make_mesh
from parallel.sharded_run import build
from parallel.strategies import from_label
from parallel.train_step import StepConfig

MMAP_ENV = {"MALLOC_MMAP_THRESHOLD_": "131072"}


@dataclasses.dataclass(frozen=True)
class CheckConfig:
    strategy: str
    remat: str
    d_model: int = 384
    n_layers: int = 4
    n_heads: int = 6
    d_ff: int = 1536
    dtype: str = "bfloat16"
    seq_len: int = 128
    micro_batch: int = 2  # sequences per device per micro-step
    micro_steps: int = 2
    devices: int = 8

    @property
    def name(self) -> str:
        return (f"{self.strategy} remat={self.remat} d{self.d_model} L{self.n_layers} "
                f"{self.dtype} mb{self.micro_batch}x{self.micro_steps} T{self.seq_len}")

    def model(self) -> ModelConfig:
        return ModelConfig(d_model=self.d_model, n_layers=self.n_layers, n_heads=self.n_heads,
                           d_ff=self.d_ff, max_len=self.seq_len, param_dtype=self.dtype,
                           compute_dtype=self.dtype, remat=self.remat)


def anonymous_resident() -> int:
    """Bytes of this process's anonymous resident memory (RssAnon): the heap and mmapped
    buffers, without the shared libraries' code pages, which the kernel may drop or fault in
    at any time and which would otherwise move the measurement."""
    return _status_bytes("RssAnon")["RssAnon"]


def _status_bytes(*fields: str) -> dict[str, int]:
    """The named sizes of /proc/self/status (kB there), in bytes, from one read of it."""
    text = open("/proc/self/status").read()
    return {f: 1024 * int(re.search(rf"{f}:\s+(\d+)", text).group(1)) for f in fields}


def reset_peak_resident() -> bool:
    """Reset the kernel's high-water mark of this process's resident set (VmHWM) to the present
    resident set (Linux: "5" into /proc/self/clear_refs); False where that is not allowed."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
        "fordblks", "keepcost")]


@functools.cache
def _mallinfo2():
    """glibc's mallinfo2 (2.33 and later), or None where there is none."""
    try:
        fn = ctypes.CDLL("libc.so.6").mallinfo2
    except (OSError, AttributeError):
        return None
    fn.restype = _MallInfo2
    return fn


def malloc_in_use() -> tuple[int, int] | None:
    """(large, small): bytes glibc has handed out and not taken back, in blocks it mmapped
    (every block of the mmap threshold or more) and in its heaps (every smaller one), summed
    over all of its arenas; None without glibc. Unlike the resident set, it does not depend on
    how much freed memory the heaps still hold."""
    fn = _mallinfo2()
    if fn is None:
        return None
    info = fn()
    return info.hblkhd, info.uordblks


class PeakSampler:
    """The largest value of `read()` while the block runs (read every `every_s` by a thread;
    the main thread waits for XLA without holding the GIL), element-wise for a tuple (as
    `malloc_in_use` returns)."""

    def __init__(self, read=anonymous_resident, every_s: float = 0.001):
        self.read, self.every_s, self._stop = read, every_s, threading.Event()
        self.peak = None

    def _sample(self) -> None:
        value = self.read()
        if self.peak is None:
            self.peak = value
        elif isinstance(value, tuple):
            self.peak = tuple(max(a, b) for a, b in zip(self.peak, value, strict=True))
        else:
            self.peak = max(self.peak, value)

    def _run(self) -> None:
        while not self._stop.is_set():
            self._sample()
            time.sleep(self.every_s)

    def __enter__(self) -> PeakSampler:
        self._sample()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self._sample()


def _block(tree) -> None:
    jax.block_until_ready(tree)


def runtime_baseline(devices: int) -> dict:
    """What a first run costs the runtime itself, measured as `check` measures a step: the
    resident-set growth, per device, of the first run of a program that holds almost nothing (a
    small vector sharded over every device, doubled and summed across them). Its compiled peak
    is a few KB; whatever else the run adds (threads, collective buffers) is outside XLA's
    accounting, as it is for every step. Needs a fresh process, like `check`."""
    mesh = make_mesh(devices)
    x = jax.device_put(np.ones(devices * 1024, np.float32),
                       NamedSharding(mesh, PartitionSpec(mesh.axis_names)))
    program = jax.jit(lambda v: (v * 2.0).sum()).lower(x).compile()
    _block(x)
    base = anonymous_resident()
    with PeakSampler() as sampler:
        _block(program(x))
    return {"devices": devices, "compiled_peak_bytes": hlo.memory_peak(program).peak,
            "executed_first_run_bytes": (sampler.peak - base) / devices}


def check(cfg: CheckConfig, seed: int = 0) -> dict:
    """Compile, allocate, run one step; compiled and executed peaks per device (bytes).
    Needs a fresh process with cfg.devices fake devices (see module doc)."""
    model = cfg.model()
    tx = make_optimizer(TrainConfig())
    run = build(model, from_label(cfg.strategy), make_mesh(cfg.devices), tx,
                StepConfig(global_batch=cfg.micro_batch * cfg.devices, seq_len=cfg.seq_len,
                           micro_steps=cfg.micro_steps))
    lowered = run.step.lower(*run.abstract_args())
    start = time.perf_counter()
    planned = hlo.memory_peak(lowered.compile(compiler_options=COMPILER_OPTIONS))
    planner_compile_s = time.perf_counter() - start
    executable = lowered.compile()
    compiled = hlo.memory_peak(executable)
    # The state is allocated by a program of broadcast zeros: outputs only, no temporaries (an
    # initialiser's temporaries would stay allocated after its run and count as inputs). The
    # values change no buffer of the step.
    zeros = jax.jit(lambda: jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype),
                                         run.abstract_state),
                    out_shardings=run.shardings).lower().compile()
    tokens = np.random.default_rng(seed).integers(
        0, model.vocab_size, (cfg.micro_steps, cfg.micro_batch * cfg.devices, cfg.seq_len + 1),
        dtype=np.int32)

    before, malloc_before = anonymous_resident(), malloc_in_use()
    state = zeros()
    batch = jax.device_put(tokens, run.batch_sharding)
    _block((state, batch))
    inputs = anonymous_resident() - before
    # One step, sampled from its start: it allocates its temporaries as it begins and gives
    # them back when it ends.
    # The kernel keeps the exact peak too (VmHWM, reset here), but of the whole resident set:
    # pages of the shared libraries first touched by this step are taken out again below.
    watermark = reset_peak_resident()
    shared_kinds = ("RssFile", "RssShmem")
    before_step = _status_bytes("RssAnon", "VmRSS", *shared_kinds)
    with PeakSampler() as sampler:
        state, metrics = executable(state, batch)
        _block((state, metrics))
    step = sampler.peak - before_step["RssAnon"]
    executed = (inputs + step) / cfg.devices
    high_water = {}
    if watermark:
        after = _status_bytes("VmHWM", *shared_kinds)
        shared = sum(after[k] - before_step[k] for k in shared_kinds)
        high_water = {"executed_step_high_water_bytes":
                      (after["VmHWM"] - before_step["VmRSS"] - shared) / cfg.devices}
    malloc = {}
    if malloc_before is not None:
        # A second step, read through glibc's counts instead (their lock would slow the first
        # step's sampling): how the step's memory splits between XLA's arrays and temporaries
        # (blocks of the mmap threshold or more; with the state and the batch, against the
        # compiled peak) and the runtime's small allocations, which no compiled peak holds.
        malloc_base = malloc_in_use()
        with PeakSampler(malloc_in_use) as in_use:
            state, metrics = executable(state, batch)
            _block((state, metrics))
        large, small = in_use.peak
        malloc = {"executed_large_blocks_peak_bytes": (large - malloc_before[0]) / cfg.devices,
                  "executed_small_blocks_step_bytes": (small - malloc_base[1]) / cfg.devices}
    return {
        "name": cfg.name, **dataclasses.asdict(cfg),
        "compiled_peak_bytes": compiled.peak, "planner_peak_bytes": planned.peak,
        "argument_bytes": compiled.argument, "temp_bytes": compiled.temp,
        "executed_peak_bytes": executed,
        "executed_inputs_bytes": inputs / cfg.devices,
        "executed_step_bytes": step / cfg.devices,
        **high_water,
        **malloc,
        "error": planned.peak / executed - 1,
        "executable_vs_planner": compiled.peak / planned.peak - 1,
        "planner_compile_s": round(planner_compile_s, 2),
        "loss": float(metrics["loss"]),
        "malloc_mmap_threshold": os.environ.get("MALLOC_MMAP_THRESHOLD_"),
    }
