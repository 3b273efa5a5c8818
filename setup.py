"""megatron-sglang-rl: asynchronous RL post-training on Megatron-Core + SGLang (LlamaRL).

Dependencies are read from requirements/*.txt, the same files that define the cached
development venv (tools/setup_env.sh), so the two cannot drift apart.
"""

from pathlib import Path

from setuptools import find_packages, setup

HERE = Path(__file__).parent


def _requirements(name: str) -> list[str]:
    lines = (HERE / "requirements" / name).read_text().splitlines()
    return [ln.strip() for ln in lines if ln.strip() and not ln.lstrip().startswith("#")]


_base = _requirements("base.txt")
_dev = {"pytest", "pytest-timeout", "ruff"}

setup(
    name="megatron-sglang-rl",
    version="0.1.0",
    description="Asynchronous RL post-training (LlamaRL design) on Megatron-Core and SGLang",
    long_description=(HERE / "README.md").read_text(),
    long_description_content_type="text/markdown",
    python_requires=">=3.11",
    packages=find_packages(include=["rl", "rl.*", "megatron_patches", "megatron_patches.*"]),
    include_package_data=True,
    install_requires=[r for r in _base if r.split("=")[0].split(">")[0].strip() not in _dev],
    extras_require={
        "dev": [r for r in _base if r.split("=")[0].split(">")[0].strip() in _dev],
        # The generator executor (SGLang servers and their HTTP client). The README's setup
        # (tools/setup_env.sh) always installs it: the main job uses it.
        "sglang": _requirements("sglang.txt"),
        # GPU extras are detected at run time, never required. NVIDIA apex is not on PyPI
        # (PyPI's "apex" is an unrelated package and must never be installed).
        "gpu": ["transformer-engine[pytorch]"],
    },
)
