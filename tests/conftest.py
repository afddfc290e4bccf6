"""Test set-up: eight fake CPU devices and cheaper XLA:CPU code generation, configured
before jax is imported."""
import os

# Cheaper code generation for every program the tests compile, the scripts they start
# as subprocesses included (`FAST_XLA_FLAGS` below): LLVM at -O0 and XLA:CPU's loop
# emitters instead of its fusion emitters. XLA's HLO passes (fusion decisions, the
# collective combiners, buffer assignment) are the same, so every test sees the programs
# users run, their collectives and memory figures; only the machine code is less
# optimised. A tiny model's train step compiles about 3x faster. Tests that time steps
# assert nothing about their speed.
FAST = {"xla_backend_optimization_level": 0, "xla_cpu_use_fusion_emitters": False}
FAST_XLA_FLAGS = "--xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false"
DEVICES_FLAG = "--xla_force_host_platform_device_count=8"

os.environ["XLA_FLAGS"] = " ".join(
    [os.environ.get("XLA_FLAGS", ""), FAST_XLA_FLAGS, DEVICES_FLAG]).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import pathlib  # noqa: E402
import shutil  # noqa: E402
import tempfile  # noqa: E402

import pytest  # noqa: E402

REPO = pathlib.Path(__file__).resolve().parents[1]
SUBSET_DIR = REPO.parent / "shared" / "data" / "cifar10-subset"


_CACHE_ENV = "VIT_PURE_TEST_XLA_CACHE"
# JAX reads its settings from these variables when it is imported (jax/_src/config.py:
# each option's name in capitals), so the scripts the tests start share the run's cache.
JAX_CACHE_VARS = ("JAX_COMPILATION_CACHE_DIR", "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS",
                  "JAX_COMPILATION_CACHE_MAX_SIZE")


def subprocess_env(*, cache: bool = True, **extra) -> dict:
    """This environment for a subprocess that picks its own device count: XLA_FLAGS
    without the 8 fake devices (the fast code generation stays), plus `extra`. With
    `cache=False`, without the run's compilation cache: the subprocess compiles every
    program itself (a program loaded from the cache is not compiled, so XLA dumps
    nothing for it)."""
    env = {k: v for k, v in os.environ.items()
           if k != "XLA_FLAGS" and (cache or k not in JAX_CACHE_VARS)}
    env["XLA_FLAGS"] = FAST_XLA_FLAGS
    env.update(extra)
    return env


def pytest_configure(config):
    """A compilation cache for this test run only: many tests compile the same programs (a
    run and its resume, one script on two datasets, the tiny model's default step in
    several files), and a program compiled once loads from the cache after that. The
    process that starts the run (the xdist controller, or pytest alone) makes an empty
    directory, its workers share it through the environment, and the starter removes it
    at the end, so nothing carries over between runs, unless the directory was given in
    VIT_PURE_TEST_XLA_CACHE before the run (kept then: .ci/run shares one between its two
    runs). The size limit turns on JAX's file
    lock (the `filelock` package), so two workers never read an entry while the other is
    writing it.

    The scripts the tests start (a run and its resume, the two processes of one job, the
    fault cases' jobs, a benchmark's rows) share it too, through JAX's environment
    variables, under the same lock (an flock: the kernel drops it when a holder is
    killed). Of a multi-process job only process 0 writes entries (jax's rule); the tests
    that kill a process kill process 1, or a single one only past a timeout."""
    import jax

    shared = os.environ.get(_CACHE_ENV)  # set: a worker, or a cache given from outside
    if shared:
        cache_dir = shared
    else:
        cache_dir = config._xla_cache_dir = tempfile.mkdtemp(prefix="vit-pure-test-xla-cache-")
        os.environ[_CACHE_ENV] = cache_dir  # the xdist workers start after this, with it
    settings = dict(zip(JAX_CACHE_VARS, (cache_dir, 0.2, 8 << 30)))
    os.environ.update({k: str(v) for k, v in settings.items()})  # for subprocesses
    for name, value in settings.items():
        jax.config.update(name.lower(), value)


def pytest_unconfigure(config):
    if getattr(config, "_xla_cache_dir", None):
        shutil.rmtree(config._xla_cache_dir, ignore_errors=True)


# The files that take longest, longest first; the rest follow in their usual order. The
# suite runs on two workers that each take whole files, or a whole test class, at a time
# (pyproject.toml: `-n 2 --dist loadscope --no-loadscope-reorder`) in collection order, so
# starting the long files first lets the short ones fill in at the end and both workers
# finish at about the same time.
LONGEST_FIRST = [
    "test_layout_matrix.py", "test_deviceless.py", "test_accum.py", "test_train.py",
    "test_model_parallel.py", "test_resume.py", "test_bench_study.py",
    "test_pipeline_schedules.py", "test_randaugment.py", "test_weights.py",
    "test_levers.py", "test_model.py", "test_plan.py", "test_attention.py",
    "test_layer_scale.py",
]


# The same for `-m slow`, whose long files are others: the two-process jobs, the pipeline,
# the peers' rounds, the layout matrix's slow cells (one unit per policy), the deviceless
# GPU compiles. (Seen: the alphabetical rest started these last, so one worker ran the
# faults, multiprocess and peers files while the other had finished.) The multi-process
# files are apart in the list so that the two workers rarely run two of them at once.
LONGEST_FIRST_SLOW = [
    "test_multiprocess.py", "test_pipeline.py", "test_faults.py", "test_layout_matrix.py",
    "test_peers.py", "test_deviceless.py", "test_train.py", "test_plan_cost.py",
    "test_pipeline_schedules.py",
]


def pytest_collection_modifyitems(config, items):
    markexpr = config.getoption("markexpr") or ""
    slow_only = "slow" in markexpr and "not slow" not in markexpr
    # `exhaustive` cells run only when asked for by name, also where a whole file or test
    # is `slow` (`-m slow` alone would select a slow test's exhaustive cells).
    if "exhaustive" not in markexpr:
        wider = [item for item in items if item.get_closest_marker("exhaustive")]
        if wider:
            config.hook.pytest_deselected(items=wider)
            items[:] = [item for item in items if not item.get_closest_marker("exhaustive")]
    rank = {name: i for i, name in enumerate(LONGEST_FIRST_SLOW if slow_only else LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: order kept


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


def key_bias(params):
    """The key third of the attention's qkv bias, (L, H, D) (its (3, H, D) axis: q, k, v)."""
    import numpy as np
    return np.asarray(params["blocks"]["attn"]["qkv"]["bias"])[:, 1]


def assert_adamw_params_agree(got, want, key_bias_grad, steps, lr, eps, msg="",
                              rounding_noise=None):
    """Params after `steps` AdamW steps (learning rate `lr`, `eps`) from one start: `got`
    from a strategy, `want` from the single-device reference, whose largest key-bias
    gradient entry over those steps was `key_bias_grad`.

    The key bias has no gradient in exact arithmetic: it adds q . b_k to every score of a
    query's row, and the softmax ignores a constant shift. What autodiff returns there is
    rounding noise (~1e-11, against ~0.07 for the largest entry), which AdamW, its eps
    (1e-8) far above that noise, turns into moves of about lr * noise / eps per step:
    noise of a size that depends on the program and the CPU (~1e-6 after 5 steps). So
    every other entry is compared at 2e-6, and the key bias against that bound: `steps`
    steps of lr * (largest noise) / eps, for either side."""
    import jax
    import numpy as np

    def without_key_bias(params):
        params = jax.tree.map(np.array, params)
        params["blocks"]["attn"]["qkv"]["bias"][:, 1] = 0
        return params

    assert key_bias_grad <= eps
    # `rounding_noise` (a tree of bools like the params, or None): entries whose gradient
    # was, at some step, within float32 rounding of zero against the rest of its leaf.
    # AdamW turns such a gradient's rounding into a move of up to lr a step (m / sqrt(v)
    # is its sign), as for the key bias: those entries are held to steps * 2 lr.
    noise = (jax.tree.map(lambda a: np.zeros(np.shape(a), bool), want)
             if rounding_noise is None else rounding_noise)
    for a, b, n in zip(jax.tree.leaves(without_key_bias(got)),
                       jax.tree.leaves(without_key_bias(want)), jax.tree.leaves(noise)):
        np.testing.assert_allclose(np.where(n, 0, a), np.where(n, 0, b), atol=2e-6, rtol=0,
                                   err_msg=msg)
        np.testing.assert_allclose(np.where(n, a, 0), np.where(n, b, 0),
                                   atol=2 * steps * lr, rtol=0, err_msg=f"{msg}: noise")
    np.testing.assert_allclose(key_bias(got), key_bias(want),
                               atol=2 * steps * lr * (key_bias_grad / eps), rtol=0,
                               err_msg=f"{msg}: key bias")
