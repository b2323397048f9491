"""focal_jax: selective attention (Focal Attention and Focus) in JAX / Flax NNX."""

from setuptools import find_packages, setup

setup(
    name="focal_jax",
    version="0.6.31",
    description="Focal Attention and Focus (learned-group sparse attention) in JAX / Flax NNX",
    python_requires=">=3.11",
    packages=find_packages(include=["focal_jax", "focal_jax.*"]) + ["focal_jax.kernels", "focal_jax.configs"],
    package_dir={"focal_jax.kernels": "kernels", "focal_jax.configs": "configs"},
    install_requires=[
        # jax 0.10.2 (Python 3.11, CPU) and 0.11.x (Python 3.12, GPU) are both supported.
        "jax>=0.10.2,<0.12",
        "flax>=0.12,<0.13",
        "optax>=0.2.5",
        "orbax-checkpoint>=0.11",
        "grain>=0.2.10",
        "sentencepiece>=0.2",
        "tokenizers>=0.19",
        "safetensors>=0.4",  # focal_jax.convert (Hugging Face checkpoints) and the trainer's pretrained starts
        "ml-collections>=1.0",
        "numpy>=1.26",
        "matplotlib>=3.8",
        "absl-py>=2.0",
        "tqdm>=4.60",
        "tensorboardX>=2.6",
        "pyarrow>=14",
    ],
    extras_require={
        "test": [
            "pytest>=8",
            "pytest-xdist>=3.5",  # `make test` runs the suite in 2 processes
            "hypothesis>=6.100",
            "torch==2.13.0",
            "transformers>=4.50",
            "lm_eval>=0.4.13",
            "datasets>=2.16",  # test_eval_helmet: HELMET's sampling, as `datasets` shuffles
            "rouge_score>=0.1.2",  # focal_jax.eval.helmet's ROUGE-L (infbench_qa)
            "nbclient>=0.10",  # the notebooks run headless in the tests
            "nbformat>=5.9",
            "ipykernel>=6.29",
        ],
        "eval": ["lm_eval>=0.4.13", "rouge_score>=0.1.2"],
        "gpu": ["jax[cuda]>=0.10.2,<0.12", "jax-triton>=0.3"],
        "notebooks": ["jupyter", "ipykernel"],
    },
)
