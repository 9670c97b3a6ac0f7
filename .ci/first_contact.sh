#!/usr/bin/env bash
# First contact: what a newcomer does on a fresh machine, verbatim from the README. A fresh virtual environment gets
# only the README's install line (no extras), `hf-paged generate` must answer the README's question with Paris, with
# empty hf_paged and Hugging Face caches (so SmolLM2 is fetched and converted as on a fresh machine); then the
# `[serve]` extra and the openai client are installed, `hf-paged serve` starts on a free loopback port (it must find
# the conversion, not fetch again), and a chat completion through the openai client must name Paris too.
# Every step has a time limit; on failure the step and the tail of its log are printed. Everything it made goes.
set -euo pipefail
cd "$(dirname "$0")/.."
QUESTION="What is the capital of France?"
STEP_TIMEOUT_S=${FIRST_CONTACT_STEP_TIMEOUT_S:-900}  # each step; a cold fetch and conversion takes a few minutes

pip_cache=$(python3 -m pip cache dir 2>/dev/null || true)  # (read before HOME's caches are swapped for empty ones)
root=$(mktemp -d)
server_pid=""
step_pid=""
cleanup() {
  for pid in "$step_pid" "$server_pid"; do
    if [[ -n "$pid" ]] && kill -0 "$pid" 2>/dev/null; then
      kill -TERM "$pid" 2>/dev/null || true
      wait "$pid" 2>/dev/null || true
    fi
  done
  rm -rf "$root"
}
trap cleanup EXIT
trap 'exit 143' TERM INT  # (stopped from outside, as .ci/run does when it ends: the cleanup still runs)

fail() {  # $1: what failed, then the logs to show
  local what=$1
  shift
  echo "first contact FAILED: $what" >&2
  for log in "$@"; do
    echo "--- last lines of $(basename "$log") ---" >&2
    tail -n 30 "$log" >&2
  done
  exit 1
}

step() {  # $1: name, $2: log, $3: another log to show on failure (or ""), then the command; bounded by STEP_TIMEOUT_S
  local name=$1 log=$2 also=$3 start=$SECONDS status=0
  shift 3
  # In the background and waited for, so that a TERM reaches the trap at once rather than after the step.
  timeout "$STEP_TIMEOUT_S" "$@" >"$log" 2>&1 &
  step_pid=$!
  wait "$step_pid" || status=$?
  step_pid=""
  if [[ $status -ne 0 ]]; then
    local why="exit status $status"
    [[ $status -eq 124 ]] && why="no result within ${STEP_TIMEOUT_S} s"
    fail "$name ($why, after $((SECONDS - start)) s)" "$log" ${also:+"$also"}
  fi
  echo "first contact: $name: $((SECONDS - start)) s"
}

# A fresh machine's caches: hf_paged's conversion and the hub's copy start empty. pip keeps its own cache, which only
# saves downloading the same files again.
export XDG_CACHE_HOME="$root/cache" HF_HOME="$root/hf"
[[ -n "$pip_cache" ]] && export PIP_CACHE_DIR="$pip_cache"

python3 -m venv "$root/venv"
# shellcheck disable=SC1091
source "$root/venv/bin/activate"
step "pip install torch==2.13.0 -e ." "$root/install.log" "" pip install -q torch==2.13.0 -e .

step "hf-paged generate" "$root/generate.log" "" hf-paged generate "$QUESTION" --no-progress
grep -q "Paris" "$root/generate.log" || fail "hf-paged generate did not answer with Paris" "$root/generate.log"
grep -m1 -A1 "^> " "$root/generate.log" | sed 's/^/first contact: generate: /'

step "pip install -e .[serve] openai" "$root/install_serve.log" "" pip install -q -e ".[serve]" openai

port=$(python -c "import socket; s = socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])")
hf-paged serve --host 127.0.0.1 --port "$port" >"$root/serve.log" 2>&1 &
server_pid=$!

cat >"$root/ask.py" <<'PY'
import sys
import time
import urllib.error
import urllib.request

from openai import OpenAI

base, question, deadline = sys.argv[1], sys.argv[2], time.monotonic() + float(sys.argv[3])
while True:  # the port is bound before the model loads: /health answers once it serves
    try:
        with urllib.request.urlopen(f"{base}/health", timeout=5) as health:
            if health.status == 200:
                break
    except (urllib.error.URLError, OSError):
        pass
    if time.monotonic() > deadline:
        sys.exit("the server did not become healthy in time")
    time.sleep(1)
client = OpenAI(base_url=f"{base}/v1", api_key="unused")
model = client.models.list().data[0].id
reply = client.chat.completions.create(model=model, messages=[{"role": "user", "content": question}],
                                       max_tokens=32, temperature=0)
answer = reply.choices[0].message.content
print(f"{model}: {answer}")
sys.exit(0 if "Paris" in answer else f"the answer does not name Paris: {answer!r}")
PY
step "hf-paged serve, then a chat completion through the openai client" "$root/ask.log" "$root/serve.log" \
  python "$root/ask.py" "http://127.0.0.1:$port" "$QUESTION" "$STEP_TIMEOUT_S"
sed 's/^/first contact: serve: /' "$root/ask.log"
if grep -q -E "downloading|converting" "$root/serve.log"; then
  fail "hf-paged serve fetched or converted SmolLM2 again instead of finding the conversion" "$root/serve.log"
fi

kill -TERM "$server_pid"
if ! timeout 60 tail --pid="$server_pid" -f /dev/null; then
  fail "hf-paged serve did not stop within 60 s of SIGTERM" "$root/serve.log"
fi
wait "$server_pid" && status=0 || status=$?
server_pid=""
# 143: uvicorn raises SIGTERM again once it has shut down, so that the process ends as "terminated"
[[ $status -eq 0 || $status -eq 143 ]] || fail "hf-paged serve exited with status $status after SIGTERM" \
  "$root/serve.log"
echo "first contact: passed in $SECONDS s"
