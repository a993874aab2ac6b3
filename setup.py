"""Package definition for phoenix_flax."""

from setuptools import find_packages, setup

setup(
    name="phoenix_flax",
    version="0.1.0",
    description="JAX/Equinox research sandbox for X's Phoenix recommendation models",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.11",
    packages=find_packages(include=["phoenix_flax", "phoenix_flax.*"]),
    # Every floor is the oldest version the test suite passed with, all installed at
    # their floors in one fresh venv (docs/testing.md, "The floors", has the command):
    # jax 0.8.0, equinox 0.13.1, ml_collections 1.0.0, numpy 2.0.0 (jax 0.8.0 needs numpy
    # 2) and the rest as listed, with the [test] floors but no flax (its floor needs a
    # newer jax; its tests skip). Older jax fails the suite: 0.7.0 and 0.7.2 lack
    # `jax.enable_x64`; 0.6.0 also refuses the package's explicit transfers under
    # `jax.transfer_guard` and reloads a checkpoint's int32 leaf as int64; 0.5.1 also
    # crashed in a killed run's process; older still, `jit(compiler_options=)` (< 0.4.36)
    # and multi-process CPU collectives (< 0.5.1) are missing. equinox < 0.12.2 fails to
    # import on jax >= 0.7 (`jaxlib.xla_extension` is gone), and < 0.13.1 on jax >= 0.10
    # (`batching.NotMapped` is gone), which pip would pair with an older equinox already
    # installed, or when an extra (flax) lifts jax; ml_collections < 1.0.0
    # cannot override the schema's nullable fields from the command line; tensorboardX
    # 2.6.2 is yanked. The extras' floors: the whole suite on jax 0.10.2 and numpy 2,
    # which flax 0.12.8 requires; below them matplotlib needs numpy < 2, tensorboard's
    # stub uses `np.string_` (gone in numpy 2), dm-haiku uses `jax.lib.xla_extension` and
    # orbax `jax.experimental.layout.DeviceLocalLayout`.
    # No ceiling: since 80716d6 the suite passes on jax 0.11.2 (Python 3.12) and 0.12.0.1
    # (Python 3.12 and 3.13); docs/testing.md, "Newer Pythons and jax", explains that fix
    # of the test session (not of the package).
    install_requires=[
        "jax>=0.8.0",
        "equinox>=0.13.1",
        "jaxtyping>=0.2.34",
        "optax>=0.2.5",
        "chex>=0.1.87",
        "absl-py>=2.1",
        "ml_collections>=1.0.0",
        "numpy>=2.0",
        "tensorboardX>=2.6.2.2",
    ],
    extras_require={
        "test": [
            "pytest>=8.0",
            "pytest-xdist>=3.5",
            "dm-haiku>=0.0.15",
            "tensorboard>=2.17.1",
            "matplotlib>=3.8.4",
            "nbclient>=0.10",
            "nbformat>=5.10",
            "ipykernel>=6.29",
            "flax>=0.12.8",
            "orbax-checkpoint>=0.11.17",
        ],
        # phoenix_flax.flax_nnx (tested with flax 0.12.8): Module-as-pytree rules
        # (nnx.data / nnx.static), Variable.get_value, nnx.Optimizer(model, tx, wrt=...).
        "flax": ["flax>=0.12.8", "orbax-checkpoint>=0.11.17"],
        # The ablation scripts (ablations/): REPORT.md plots, and TensorBoard to view runs.
        "ablations": ["matplotlib>=3.8.4", "tensorboard>=2.17.1"],
        "notebooks": ["matplotlib>=3.8.4", "nbclient>=0.10", "nbformat>=5.10",
                      "ipykernel>=6.29", "tensorboard>=2.17.1", "flax>=0.12.8",
                      "orbax-checkpoint>=0.11.17"],
    },
)
