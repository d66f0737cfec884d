from setuptools import find_packages, setup

# Ranges that admit a GPU machine's own CUDA build of torch and its transformers (seen: torch 2.11 +
# transformers 5.17 on an H200 image). transformers stops at the newest release tested (5.17 and
# 5.23 here), so a CI run always gets a known one. The README's and CI's command installs
# torch==2.13.0 itself, which resolves to the CPU wheel here: with no torch installed, a bare
# `pip install -e .` would take a multi-GB CUDA build.
install_requires = [
    "torch>=2.11",
    "transformers>=5.17,<=5.23.0",
    "tokenizers>=0.22",
    "safetensors>=0.4",
    "accelerate>=1.0",
    "gguf>=0.10",
    "pyzmq==27.3.0",
    "msgpack>=1.0",
    "blake3==1.0.11",  # the wire's MAC (keyed BLAKE3: faster than a memcpy here)
    "pydantic>=2.7,<3",
    "hydra-core==1.3.8",
    "networkx>=3.2",
    "matplotlib>=3.8",
    "sympy>=1.12",
    "tensorboard>=2.15",
    "reasoning-gym==0.1.25",
    "numpy",
    "aiohttp>=3.9",
    "psutil>=5.9",
    "openai==3.54.0",  # the client of OpenAI-compatible servers; its types shape the workflow chat client
    "peft>=0.21",  # LoRA adapters (actor.lora); pure Python, uses the torch above (no CUDA build pulled)
    "pyarrow>=15",  # dataset.type=parquet
    "datasets>=3,<6",  # dataset.type=hf: a folder written by save_to_disk
]

setup(
    name="realcore",
    version="0.1.0",
    description="Reinforcement learning for LLMs: a master/worker system driven by a dataflow graph",
    # experiments/ (the hydra config tree) is installed as realcore/experiments, so that a plain
    # `pip install .` or a wheel composes configs from anywhere; it stays at the repository root,
    # where the docs, tests and bench/ name its files.
    packages=find_packages(include=["realcore", "realcore.*"]) + ["realcore.experiments"],
    package_dir={"realcore.experiments": "experiments"},
    package_data={"realcore.experiments": ["*.yaml", "*/*.yaml"]},
    python_requires=">=3.10",
    install_requires=install_requires,
    extras_require={
        # The tests use every optional backend that runs on a CPU machine.
        # mkdocs-material builds the docs site (mkdocs.yml); .ci/run reads its pin from this line.
        "dev": ["pytest>=8", "pytest-timeout>=2.3", "redis==8.1.0", "etcd-sdk-python==0.0.7", "protobuf==7.36.2",
                "ray==2.60.0", "wandb==0.31.0", "mkdocs-material==9.8.1"],
        # megatron-core 0.17+ requires Python >= 3.12 (its Requires-Python); 0.16.1 is the last for 3.11.
        "megatron": ["megatron-core==0.16.1"],
        # SGLang / vLLM are installed by the user (GPU builds; see README).
        "sglang": [],
        "vllm": [],
        "ray": ["ray==2.60.0", "wandb==0.31.0"],
        # Name resolution servers. etcd-sdk-python (module `pyetcd`) needs protobuf but does not
        # declare it; the old `etcd3` client breaks on protobuf >= 4.
        "redis": ["redis==8.1.0"],
        "etcd": ["etcd-sdk-python==0.0.7", "protobuf==7.36.2"],
    },
)
