"""The ZeRO stages as data: what each one shards, and how its gradients are reduced.

| strategy   | params  | grads (kept)      | optimizer state | collectives                         |
|------------|---------|-------------------|-----------------|-------------------------------------|
| dp         | whole   | whole, all-reduce | whole           | all-reduce(grads)                   |
| zero1      | whole   | whole until step  | sharded         | reduce-scatter(grads), all-gather(p)|
| zero2      | whole   | sharded per micro | sharded         | reduce-scatter per micro, all-gather|
| zero3      | sharded | sharded           | sharded         | per-layer all-gather fwd+bwd, RS    |
| zero3_auto | sharded | sharded           | sharded         | left to the compiler (annotations)  |

The train step (parallel/train_step.py) reads these fields; it never compares names. zero3 may
also prefetch: layer i+1's gather is issued while layer i computes (parallel/prefetch.py). Its
label, where experiments list variants side by side, is `zero3_prefetch`.
"""

from __future__ import annotations

import dataclasses

# How a micro-batch's gradient reaches the optimizer.
ALL_REDUCE = "all_reduce"  # summed whole on every device, once per step (dp)
SCATTER_PER_STEP = "scatter_per_step"  # summed into shards once per step (zero1)
SCATTER_PER_MICRO = "scatter_per_micro"  # summed into shards every micro-step (zero2)
GATHER_TRANSPOSE = "gather_transpose"  # autodiff of the per-layer gather scatters it (zero3)
COMPILER = "compiler"  # left to XLA from sharding annotations (zero3_auto)

PREFETCH_SUFFIX = "_prefetch"


@dataclasses.dataclass(frozen=True)
class Strategy:
    name: str
    shards_params: bool
    shards_optimizer: bool
    grad_reduce: str
    prefetch: bool = False

    @property
    def explicit(self) -> bool:
        """Collectives written by hand under shard_map (all but zero3_auto)."""
        return self.grad_reduce != COMPILER

    @property
    def shards_grads(self) -> bool:
        """Gradients leave each micro-step already reduce-scattered (ZeRO-2 and up)."""
        return self.grad_reduce in (SCATTER_PER_MICRO, GATHER_TRANSPOSE, COMPILER)

    @property
    def gathers_layers(self) -> bool:
        """Each layer's parameters are all-gathered right before it runs, then released."""
        return self.shards_params and self.explicit

    @property
    def updates_shards_of_replicas(self) -> bool:
        """Whole parameters on every device, but each updates only its shard and the updated
        shards are all-gathered (zero1, zero2)."""
        return self.shards_optimizer and not self.shards_params

    @property
    def label(self) -> str:
        return self.name + (PREFETCH_SUFFIX if self.prefetch else "")


_BASE = {s.name: s for s in (
    Strategy("dp", shards_params=False, shards_optimizer=False, grad_reduce=ALL_REDUCE),
    Strategy("zero1", shards_params=False, shards_optimizer=True, grad_reduce=SCATTER_PER_STEP),
    Strategy("zero2", shards_params=False, shards_optimizer=True, grad_reduce=SCATTER_PER_MICRO),
    Strategy("zero3", shards_params=True, shards_optimizer=True, grad_reduce=GATHER_TRANSPOSE),
    Strategy("zero3_auto", shards_params=True, shards_optimizer=True, grad_reduce=COMPILER),
)}
STRATEGIES = tuple(_BASE)
# Every label an experiment accepts: a strategy, or a strategy that can prefetch, prefetching.
LABELS = (*STRATEGIES, "zero3" + PREFETCH_SUFFIX)


def get_strategy(name: str, prefetch: bool = False) -> Strategy:
    """The strategy called `name` (ValueError naming what is allowed otherwise)."""
    if name not in _BASE:
        raise ValueError(f"strategy={name!r}: allowed {', '.join(STRATEGIES)}")
    base = _BASE[name]
    if prefetch and not base.gathers_layers:
        raise ValueError(f"prefetch=True: only for strategy zero3, not {name!r}")
    return dataclasses.replace(base, prefetch=prefetch)


def from_label(label: str) -> Strategy:
    """'zero3_prefetch' -> zero3 with prefetch; a plain name -> that strategy."""
    if label not in LABELS:
        raise ValueError(f"strategy={label!r}: allowed {', '.join(LABELS)}")
    prefetch = label.endswith(PREFETCH_SUFFIX)
    return get_strategy(label.removesuffix(PREFETCH_SUFFIX), prefetch)
