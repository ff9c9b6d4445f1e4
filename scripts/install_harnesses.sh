#!/usr/bin/env bash
# The agent harnesses of the compatibility run (examples/harnesses/), in an environment of
# their own: build/harness-venv with exactly constraints/harnesses.txt (the OpenAI Agents
# SDK, LangChain/LangGraph, smolagents, LiteLLM, anthropic, mini-swe-agent and what they
# pull in). Idempotent: skipped while the pins are unchanged since the last install.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
venv=build/harness-venv
stamp=$venv/.install-stamp
want=$(sha256sum constraints/harnesses.txt | cut -d' ' -f1)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && "$venv/bin/python" -c "import agents, anthropic" 2>/dev/null; then
  exit 0
fi
echo "install_harnesses.sh: installing the agent harnesses into $venv"
rm -rf "$venv"
$PYTHON -m venv "$venv"
"$venv/bin/python" -m pip install -q --disable-pip-version-check -r constraints/harnesses.txt
echo "$want" > "$stamp"
