#!/usr/bin/env bash
# Makes what examples/rl_cpu needs, offline (nothing from a model hub): the vLLM venv and the example's model (as
# examples/vllm_e2e/setup.sh does, a larger one: hidden size 256, 4 layers, 2.9M parameters), then the client and worker kit installed into that venv, where the
# trainer (torch) and the workers run. The install must not move any of the venv's packages: a dry run
# lists what it would install, and anything but coda-pacer itself stops the script.
#
#   bash examples/rl_cpu/setup.sh [VENV_DIR] [MODEL_DIR]
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(cd "$here/../.." && pwd)"
venv="${1:-${CODA_VLLM_VENV:-$HOME/.cache/coda-pacer/vllm-venv}}"
model="${2:-${CODA_RL_MODEL:-$HOME/.cache/coda-pacer/rl-llama}}"

bash "$repo/examples/vllm_e2e/setup.sh" "$venv" "$model" --hidden-size 256 --layers 4

# Asked from / : run from the repository's root, Python would find the kit in the working directory and the
# install would be skipped, leaving the venv without it.
if ! (cd / && "$venv/bin/python" -c "import coda_worker.engines.vllm") 2>/dev/null; then
    report="$(mktemp)"
    "$venv/bin/pip" install --quiet --dry-run --report "$report" "$repo[worker]"
    "$venv/bin/python" - "$report" <<'PY'
import json, sys
installs = json.load(open(sys.argv[1]))["install"]
others = [f'{i["metadata"]["name"]}=={i["metadata"]["version"]}' for i in installs
          if i["metadata"]["name"].lower() != "coda-pacer"]
if others:
    sys.exit("setup: installing the client would change the vLLM venv's packages: " + ", ".join(others))
print("setup: the client installs into the vLLM venv without changing any of its packages", file=sys.stderr)
PY
    rm -f "$report"
    "$venv/bin/pip" install --quiet --no-deps -e "$repo"
fi
echo "setup: ready: CODA_VLLM_PYTHON=$venv/bin/python CODA_RL_MODEL=$model" >&2
