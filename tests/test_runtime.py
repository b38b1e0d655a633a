"""experiments.cli.runtime's decision whether the started backend can run a model config, from the
facts a backend reports (no GPU needed to check each case)."""

import dataclasses

import pytest

from experiments.cli.runtime import attention_here, backend_refusal, cudnn_refusal
from model import ModelConfig

FUSED = ModelConfig(d_model=512, n_heads=4, attention="cudnn", compute_dtype="bfloat16")  # dim 128
WIDE = dataclasses.replace(FUSED, n_heads=2)  # head dim 256: Hopper or later


@pytest.mark.parametrize("cfg,backend,version,capability,expected", [
    (FUSED, "gpu", "cuda 12080", "9.0", None),
    (FUSED, "gpu", "cuda 12080", "8.0", None),
    (WIDE, "gpu", "cuda 12080", "9.0", None),
    (WIDE, "gpu", "cuda 12080", "8.6", "a head dimension of 256 needs a Hopper or later GPU "
                                       "(at most 128 on compute capability 8.6"),
    (FUSED, "gpu", "rocm 60342", None, "needs an NVIDIA GPU, the JAX backend is ROCm"),
    (FUSED, "cpu", "cpu", None, "needs an NVIDIA GPU, the JAX backend is 'cpu'"),
    (FUSED, "tpu", "PJRT C API", None, "needs an NVIDIA GPU, the JAX backend is 'tpu'"),
    (dataclasses.replace(WIDE, attention="xla"), "cpu", "cpu", None, None),
])
def test_cudnn_refusal_names_what_the_backend_lacks(cfg, backend, version, capability, expected):
    problem = cudnn_refusal(cfg, backend, version, capability)
    if expected is None:
        assert problem is None
    else:
        assert problem.startswith(f"attention='cudnn': {expected}") and "\n" not in problem
        assert problem.endswith("use --attention xla)")


def test_this_backend_runs_xla_attention_and_evaluates_a_cudnn_run_with_it():
    assert backend_refusal(dataclasses.replace(FUSED, attention="xla")) is None
    here = attention_here(FUSED)
    if backend_refusal(FUSED) is None:  # an NVIDIA GPU: the fused kernel stays
        assert here == FUSED
    else:
        assert here == dataclasses.replace(FUSED, attention="xla")
