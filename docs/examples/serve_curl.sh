#!/usr/bin/env bash
# Talk to `nanoserve serve` with curl. tests/test_serve_docs.py runs this file against a live server.
set -euo pipefail
URL=${NANOSERVE_URL:-http://127.0.0.1:8000}
MODEL=${NANOSERVE_MODEL:-smollm2}
AUTH=(-H "Authorization: Bearer ${NANOSERVE_API_KEY:-none}")   # needed only when the server has --api-key

# Which model does the server serve?
curl -sf "${AUTH[@]}" "$URL/v1/models"
echo

# A completion, whole.
curl -sf "${AUTH[@]}" "$URL/v1/completions" -H "Content-Type: application/json" \
  -d "{\"model\": \"$MODEL\", \"prompt\": \"The capital of France is\", \"max_tokens\": 8, \"temperature\": 0}"
echo

# A chat, streamed as server-sent events (one `data:` line per step, then `data: [DONE]`).
curl -sfN "${AUTH[@]}" "$URL/v1/chat/completions" -H "Content-Type: application/json" \
  -d "{\"model\": \"$MODEL\", \"messages\": [{\"role\": \"user\", \"content\": \"What is a KV cache?\"}],
       \"max_tokens\": 8, \"stream\": true}"

# The engine's state (its first 200 characters), and its numbers for Prometheus. (Read whole first:
# piping curl into `head` can fail the script with curl's "write error" when head stops reading.)
snapshot=$(curl -sf "${AUTH[@]}" "$URL/snapshot")
echo "${snapshot:0:200}"
metrics=$(curl -sf "${AUTH[@]}" "$URL/metrics")
grep '^nanoserve_requests{' <<<"$metrics"
