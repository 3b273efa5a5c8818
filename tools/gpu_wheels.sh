#!/usr/bin/env bash
# The packages a GPU machine without a package index lacks for tools/gpu_check.sh, as
# wheels in .whl/ (ignored by git), at the versions this project's venv holds.
#
#   tools/gpu_wheels.sh                  # here, where pip reaches an index
#   MSRL_PYTHON=python3 tools/gpu_check.sh   # there, with .whl/ copied along: it installs them
#
# Why: such a machine (a lent H100 or H200 with torch, Triton and transformers in its image,
# and no index) lacks Megatron-Core and Hydra, and may hold another transformers. The wheels
# are for its Python (MSRL_GPU_PYTHON_VERSION, 3.12) on x86-64; antlr4 4.9.3, which Hydra
# pins and which PyPI has only as source, is built here into a pure-Python wheel. Nothing
# else is fetched: the machine's own numpy, safetensors, tokenizers, huggingface-hub, psutil
# and PyYAML serve (seen on 2026-11-27: the check passed with these five carried).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
py="${MSRL_PYTHON:-$(tools/setup_env.sh)/bin/python}"
pyver="${MSRL_GPU_PYTHON_VERSION:-3.12}"
dest="$root/.whl"
rm -rf "$dest"
mkdir -p "$dest"
# The venv's versions, so that the GPU machine runs what CI tests.
mapfile -t pins < <("$py" - <<'PY'
from importlib.metadata import version
for name in ("megatron-core", "hydra-core", "omegaconf", "transformers", "antlr4-python3-runtime"):
    print(f"{name}=={version(name)}")
PY
)
platforms=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64 \
  manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64; do
  platforms+=(--platform "$p")
done
"$py" -m pip download -q --no-deps --only-binary=:all: --python-version "$pyver" \
  --implementation cp "${platforms[@]}" -d "$dest" "${pins[@]:0:4}"
"$py" -m pip wheel -q --no-deps -w "$dest" "${pins[4]}"  # antlr4: source only on PyPI
ls -l "$dest"
echo "$(du -sh "$dest" | cut -f1) in $dest: copy it along with the tree; tools/gpu_check.sh installs what it finds there"
