"""Test set-up: eight fake CPU devices, configured before jax is imported."""
import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import pathlib  # noqa: E402

import pytest  # noqa: E402

REPO = pathlib.Path(__file__).resolve().parents[1]
SUBSET_DIR = REPO.parent / "shared" / "data" / "cifar10-subset"


@pytest.fixture(scope="session")
def subset_dir():
    if not (SUBSET_DIR / "cifar-10-batches-py").is_dir():
        pytest.skip(f"CIFAR-10 subset not found at {SUBSET_DIR}")
    return SUBSET_DIR


def grads_step(strategy):
    """jit(shard_map(...)) of a ShardMapStrategy's gradient half (`global_grads`), with
    the train step's input specs: (state, images, labels, example ids, key) -> (the
    gradients of the global mean loss laid out like the params, metrics)."""
    import jax
    from jax.sharding import PartitionSpec as P

    batch = P("data")
    return jax.jit(jax.shard_map(
        strategy.global_grads, mesh=strategy.mesh,
        in_specs=(strategy.state_specs, batch, batch, batch, P()),
        out_specs=(strategy.param_specs, P())))
