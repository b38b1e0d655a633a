"""What stops a run early: a non-finite loss, gradient or update, a checkpoint or log that
cannot be written, and a polite SIGTERM (preemption).

The train step itself never lets a NaN/Inf into the state (parallel/train_step.py keeps the old
state and reports `finite=False`); here the host decides what to do about it, one step behind
so that reading the flag does not stall the device pipeline.
"""

from __future__ import annotations

import signal
import threading

import jax
import numpy as np
from jax.experimental import multihost_utils

NONFINITE_POLICIES = ("stop", "skip")


class RunStopped(RuntimeError):
    """The run stopped early for the one-line reason in its message. Launchers exit with status
    1 (not 2: the input was fine)."""


class NonFiniteError(RunStopped):
    """The run stopped on a NaN/Inf; the message names the step."""


class WriteFailed(RunStopped):
    """A checkpoint, manifest or log could not be written (a full disk, a file-size limit); the
    message names what, and the newest sealed checkpoint to resume from."""


class FiniteWatch:
    def __init__(self, policy: str):
        if policy not in NONFINITE_POLICIES:
            raise ValueError(f"on_nonfinite={policy!r}: allowed {', '.join(NONFINITE_POLICIES)}")
        self.policy = policy
        self.skipped = 0
        self._pending: tuple[int, dict] | None = None

    def push(self, step: int, metrics: dict) -> None:
        """Record this step's metrics and check the previous step's (already finished) ones."""
        previous, self._pending = self._pending, (step, metrics)
        if previous is not None:
            self._check(*previous)

    def flush(self) -> None:
        """Check the latest step now (before a checkpoint, an evaluation or the end)."""
        if self._pending is not None:
            pending, self._pending = self._pending, None
            self._check(*pending)

    def _check(self, step: int, metrics: dict) -> None:
        if bool(metrics["finite"]):
            return
        self.skipped += 1
        if self.policy == "stop":
            loss, norm = float(metrics["loss"]), float(metrics["grad_norm"])
            what = (f"loss {loss} / gradient norm {norm} is not finite"
                    if not (np.isfinite(loss) and np.isfinite(norm)) else
                    f"the update made the parameters non-finite (loss {loss} and gradient norm "
                    f"{norm} were finite: is the learning rate too large?)")
            raise NonFiniteError(
                f"step {step}: {what}; the state was left as after step {step - 1} and nothing "
                f"non-finite was saved (--on-nonfinite skip skips such steps instead)")


class Preemption:
    """SIGTERM (what cluster schedulers send) asks the run to checkpoint and exit cleanly.

    With several processes, all must stop at the same step to save together, so the request is
    agreed on with a tiny all-gather each step (only when there is more than one process).
    """

    def __init__(self):
        self._requested = False
        self._previous = None

    def __enter__(self) -> Preemption:
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGTERM, self._on_signal)
        return self

    def __exit__(self, *exc) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)

    def _on_signal(self, signum, frame) -> None:
        self._requested = True

    def requested(self) -> bool:
        if jax.process_count() == 1:
            return self._requested

        flags = multihost_utils.process_allgather(np.array(self._requested))
        return bool(np.any(flags))
