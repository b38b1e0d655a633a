"""Sharded training against the single-device reference, for every strategy and mesh; the
reference itself against pinned losses and against AdamW steps written out with optax; the live
train state's shards on the 8 devices."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from experiments.training.optim import learning_rate, make_optimizer
from parallel.mesh import make_mesh, parse_mesh
from parallel.sharded_run import build
from parallel.state import abstract_model, init_params
from parallel.strategies import get_strategy
from parallel.train_step import StepConfig
from tests.helpers import TINY, max_tree_diff, run_steps, synthetic_batches, with_model

# The tiny preset warms up from a learning rate of 0, so its first update is exactly zero. Here
# the rate is at its peak from the first update on: every step of every comparison below moves
# the parameters through AdamW.
TRAIN = dataclasses.replace(TINY.train, warmup_steps=0)
BATCHES = synthetic_batches(5, micro=2, batch=16, seq_len=TINY.model.max_len)


@pytest.fixture(scope="module")
def reference():
    return run_steps("dp", 1, BATCHES, train=TRAIN)


def test_losses_after_four_updates_are_pinned(reference):
    losses, _ = reference
    assert np.float32(learning_rate(TRAIN)(0)) == np.float32(TRAIN.lr)  # a real first update
    # Obtained by running this reference once (dp on 1 device, tiny preset with TRAIN above,
    # seed 0, BATCHES above) and printing `losses`: losses[0] is the initial model's, losses[k]
    # follows k AdamW updates. Any change to init, model, loss or optimizer maths shows up here.
    np.testing.assert_allclose(losses, PINNED_LOSSES, rtol=1e-5)


PINNED_LOSSES = [6.1311635971, 5.8919296265, 5.7772111893, 5.6093726158, 5.4042010307]


def optax_reference(params, batches):
    """Parameters after each of len(batches) steps, written without the project's train step:
    value_and_grad of the plain single-device model's mean next-token NLL (micro-batches are
    just more rows), then optax's own global-norm clipping and AdamW with TRAIN's
    hyper-parameters and schedule, weight decay on matmul kernels only."""
    graphdef, _, _ = abstract_model(TINY.model)

    def loss_fn(p, tokens):
        logits = nnx.merge(graphdef, p)(tokens[:, :-1])
        logp = jax.nn.log_softmax(logits, axis=-1)
        return -jnp.mean(jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1))

    schedule = optax.warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=TRAIN.lr, warmup_steps=TRAIN.warmup_steps,
        decay_steps=TRAIN.steps, end_value=TRAIN.lr * TRAIN.min_lr_ratio)
    kernels_only = lambda p: jax.tree_util.tree_map_with_path(
        lambda path, _: path[-1].key == "kernel", p)
    tx = optax.chain(optax.clip_by_global_norm(TRAIN.clip_norm),
                     optax.adamw(schedule, b1=TRAIN.b1, b2=TRAIN.b2, eps=1e-8,
                                 weight_decay=TRAIN.weight_decay, mask=kernels_only))
    opt, out = tx.init(params), []
    grad_fn = jax.jit(jax.value_and_grad(loss_fn))
    for b in batches:
        _, g = grad_fn(params, jnp.asarray(b.reshape(-1, b.shape[-1])))
        updates, opt = tx.update(g, opt, params)
        params = optax.apply_updates(params, updates)
        out.append(jax.device_get(params))
    return out


def test_train_step_matches_a_hand_written_optax_step():
    """The project's step (dp, one device) against optax_reference, after one and two steps
    (the second also checks the moments carried over)."""
    micro, batch, length = BATCHES[0].shape
    run = build(TINY.model, get_strategy("dp"), make_mesh(1), make_optimizer(TRAIN),
                StepConfig(global_batch=batch, seq_len=length - 1, micro_steps=micro,
                           clip_norm=TRAIN.clip_norm))
    state = run.init(TRAIN.seed)
    init = jax.device_get(state["params"])
    # jitted init rounds like eager init up to an ulp; the reference starts from `init` itself
    assert max_tree_diff(init, init_params(TINY.model, TRAIN.seed)) <= 1e-6
    got = []
    for b in BATCHES[:2]:
        state, _ = run.step(state, jax.device_put(b, run.batch_sharding))
        got.append(jax.device_get(state["params"]))
    want = optax_reference(init, BATCHES[:2])
    for g, w in zip(got, want, strict=True):
        # Measured 3e-7 (a few ulps: the two sum the loss in another order); a step moves
        # parameters by up to the learning rate, 3e-3, and weight decay alone by ~1e-4.
        assert max_tree_diff(g, w) <= 2e-6
    # Not vacuous: each step moves some parameter by about the learning rate.
    assert max_tree_diff(got[0], init) > 0.5 * TRAIN.lr
    assert max_tree_diff(got[1], got[0]) > 0.5 * TRAIN.lr


# Every strategy on 8 devices; the 2-device and 2x4-mesh cells for the strategies whose sharding
# they change (experiments.equivalence runs the full grid, in bf16 too).
CELLS = ([(s, 8, None) for s in ("dp", "zero1", "zero2", "zero3", "zero3_prefetch", "zero3_auto")]
         + [(s, 2, None) for s in ("zero2", "zero3")]
         + [(s, 8, "data=2,fsdp=4") for s in ("zero1", "zero3", "zero3_prefetch")])


@pytest.mark.parametrize("strategy,devices,mesh", CELLS)
def test_sharded_training_matches_single_device(reference, strategy, devices, mesh):
    ref_losses, ref_params = reference
    losses, params = run_steps(strategy, devices, BATCHES, mesh, train=TRAIN)
    assert np.abs(losses - ref_losses).max() <= 1e-5
    assert max_tree_diff(params, ref_params) <= 1e-5


@pytest.mark.parametrize("strategy", ["zero3"])  # bf16 gathers, f32 master shards
def test_mixed_precision_tracks_fp32(reference, strategy):
    """bf16 working params/compute with fp32 master weights stays close to the fp32 run."""
    ref_losses, _ = reference
    bf16 = with_model(param_dtype="bfloat16", compute_dtype="bfloat16")
    single, _ = run_steps("dp", 1, BATCHES, model=bf16, train=TRAIN)
    losses, _ = run_steps(strategy, 8, BATCHES, model=bf16, train=TRAIN)
    assert (np.abs(losses - ref_losses) / ref_losses).max() < 0.02  # bf16-rounded init too
    assert np.abs(losses - single).max() < 5e-3


def test_mesh_parsing_errors():
    assert parse_mesh("data=2,fsdp=4", 8) == {"data": 2, "fsdp": 4}
    with pytest.raises(ValueError, match="must equal the device count 8"):
        parse_mesh("data=3,fsdp=2", 8)
    with pytest.raises(ValueError, match="expected comma-separated"):
        parse_mesh("model=8", 8)
    with pytest.raises(ValueError, match="devices=16: only 8 available"):
        make_mesh(16)


# The dimension of each tiny-model parameter that holds d_model (its `embed` axis), written out
# by hand from the model's shapes: what ZeRO-3 splits over the 8 devices.
EMBED_DIM = {"blocks/attn/q/kernel": 1, "blocks/attn/k/kernel": 1, "blocks/attn/v/kernel": 1,
             "blocks/attn/o/kernel": 2, "blocks/attn_norm/scale": 1, "blocks/mlp/up/kernel": 1,
             "blocks/mlp/down/kernel": 2, "blocks/mlp_norm/scale": 1, "embed/embedding": 1,
             "final_norm/scale": 0, "head/kernel": 0}


def live_leaves(tree):
    """{"a/b/c": array} of a state sub-tree."""
    return {"/".join(str(getattr(k, "key", k)) for k in path): leaf
            for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]}


def assert_split_8_way(arr, dim):
    shards = arr.addressable_shards
    assert len(shards) == 8 and not arr.sharding.is_fully_replicated
    want = tuple(s // 8 if i == dim else s for i, s in enumerate(arr.shape))
    assert all(s.data.shape == want for s in shards)
    starts = sorted(s.index[dim].start or 0 for s in shards)  # 8 disjoint slices cover it
    assert starts == [i * want[dim] for i in range(8)]


def assert_whole_everywhere(arr):
    assert arr.sharding.is_fully_replicated and len(arr.addressable_shards) == 8
    assert all(s.data.shape == arr.shape for s in arr.addressable_shards)


@pytest.mark.parametrize("strategy", ["zero3", "zero1", "dp"])
def test_live_state_shards(n_devices, strategy):
    """The state as initialised on the 8 devices: ZeRO-3 splits parameters and both Adam
    moments 8-way on their embed dimension; ZeRO-1 only the moments; dp holds whole copies."""
    run = build(TINY.model, get_strategy(strategy), make_mesh(n_devices), make_optimizer(TRAIN),
                StepConfig(global_batch=8, seq_len=TINY.model.max_len))
    state = run.init(0)
    adam = state["opt"]["adam"][0]  # (ScaleByAdamState, ...) of optax.adamw's chain
    parts = {"params": state["params"], "mu": adam.mu, "nu": adam.nu}
    for name, tree in parts.items():
        leaves = live_leaves(tree)
        assert sorted(leaves) == sorted(EMBED_DIM)
        split = strategy == "zero3" or (strategy == "zero1" and name != "params")
        for path, arr in leaves.items():
            if split:
                assert_split_8_way(arr, EMBED_DIM[path])
            else:
                assert_whole_everywhere(arr)
    assert_whole_everywhere(state["step"])


def test_a_device_request_after_the_backend_started_holds_only_for_its_own_count():
    """The session's backend started with 8 CPU devices (tests/conftest.py): asking for 8 again
    (a second launcher in the same process) has what it asks for; any other count would be
    ignored, so it is refused."""
    from parallel.devices import request_cpu_devices

    n = len(jax.devices("cpu"))
    request_cpu_devices(n)
    with pytest.raises(RuntimeError, match="after JAX started its backends"):
        request_cpu_devices(n + 1)
