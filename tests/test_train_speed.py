"""The training-speed benchmark: its figures are sane, its breakdown adds up, each optimisation
it measures really changes the compiled step and none changes the numbers."""

import dataclasses
import json
import subprocess
import sys

import numpy as np
import pytest

from experiments.speed import step_profile, step_variants
from experiments.speed import training as train_speed
from experiments.training.optim import make_optimizer
from parallel.mesh import make_mesh
from parallel.sharded_run import build
from parallel.strategies import from_label
from parallel.train_step import StepConfig
from tests.helpers import TINY, max_tree_diff, run_steps, synthetic_batches

ONE_DEVICE = dataclasses.replace(TINY, train=dataclasses.replace(TINY.train, devices=1))


def test_bench_on_the_tiny_config_reports_sane_figures():
    out = train_speed.bench(ONE_DEVICE, steps=2, warmup=1, profile_steps=1, peak_size=256)
    assert out["devices"] == 1 and out["tokens_per_s"] > 0 and out["model_flops_per_s"] > 0
    assert out["tokens_per_s"] == pytest.approx(16 * 32 / out["median_step_s"])
    assert 0 < out["fraction_of_peak"] and out["matmul_peak_flops_per_s"] > 0
    fractions = out["breakdown"]["fractions"]
    assert set(fractions) == set(step_profile.CATEGORIES)
    assert sum(fractions.values()) == pytest.approx(1.0)
    assert all(0 <= f <= 1 for f in fractions.values())
    # The scopes reach the compiled program: the model's parts each land in their group.
    for group in ("matmul", "attention", "norms_rope_elementwise", "loss", "optimizer"):
        assert fractions[group] > 0, group
    assert sum(out["flop_shares"].values()) == pytest.approx(1.0)
    assert 0 < out["flop_shares"]["attention"] < out["flop_shares"]["matmul"]
    assert "torch" not in out  # no reference interpreter given
    json.dumps(out)  # what the launcher writes


def test_operations_are_grouped_by_scope_then_by_dot():
    def op(name, has_dot=False, opcode="fusion"):
        return {"opcode": opcode, "op_name": name, "has_dot": has_dot, "shape": ""}

    cat = step_profile.categorize
    assert cat(op("jit(f)/while/body/transpose(jvp(attention_core))/dot_general", True)) == \
        "attention"
    assert cat(op("jit(f)/optimizer_update/mul")) == "optimizer"
    assert cat(op("jit(f)/jvp(embedding_lookup)/jit(_take)/gather")) == "embedding"
    assert cat(op("jit(f)/transpose(jvp(nll_loss))/broadcast_in_dim")) == "loss"
    assert cat(op("jit(f)/closed_call/dot_general", True)) == "matmul"
    assert cat(op("jit(f)/closed_call/tanh")) == "norms_rope_elementwise"
    assert cat(op("jit(f)/shard_map/psum", opcode="all-reduce")) == "collectives"
    # A scope name inside another word is not that scope.
    assert cat(op("jit(f)/not_attention_core_x/mul")) == "norms_rope_elementwise"


# The tiny model's whole context: 32 positions go to attention in two query blocks, so undoing
# the blocks changes the program.
SEQ = TINY.model.max_len


def _lowered_text(undo=()) -> str:
    with step_variants.undone(undo):
        run = build(TINY.model, from_label("dp"), make_mesh(1), make_optimizer(TINY.train),
                    StepConfig(global_batch=4, seq_len=SEQ))
        return run.step.lower(*run.abstract_args()).as_text()


def test_each_optimisation_changes_the_program_but_not_the_numbers():
    text = _lowered_text()
    for name in step_variants.CHANGES:
        assert _lowered_text((name,)) != text, f"undoing {name} changes nothing: nothing measured"
    assert _lowered_text() == text  # undone() put the current implementations back
    batches = synthetic_batches(2, 1, 4, SEQ)
    losses, params = run_steps("dp", 1, batches)
    with step_variants.undone(tuple(step_variants.CHANGES)):
        before_losses, before_params = run_steps("dp", 1, batches)
    np.testing.assert_allclose(losses, before_losses, rtol=1e-6)
    assert max_tree_diff(params, before_params) < 1e-6


def test_torch_command_carries_the_model_dims():
    cmd = train_speed.torch_command("/py", ONE_DEVICE, steps=3, warmup=1)
    args = dict(zip(cmd[2::2], cmd[3::2], strict=False))
    assert cmd[:2] == ["/py", str(train_speed.TORCH_SCRIPT)]
    assert args["--d-model"] == "32" and args["--n-layers"] == "2" and args["--batch"] == "16"
    assert args["--seq-len"] == "32" and "--tie" not in cmd


def test_bad_torch_python_is_one_line_exit_2_nothing_written(tmp_path):
    out = tmp_path / "bench.json"
    proc = subprocess.run([sys.executable, "-m", "experiments.bench_train", "--preset", "tiny",
                           "--torch-python", str(tmp_path / "nope"), "--out", str(out)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip().startswith("experiments.bench_train: error: torch_python=")
    assert len(proc.stderr.strip().splitlines()) == 1 and not out.exists()
