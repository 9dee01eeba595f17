#!/bin/sh
# Against `make serve`: one chat completion, then a streamed one with usage at the end.
BASE=${LMSTACK_URL:-http://127.0.0.1:8000}

curl -s "$BASE/v1/chat/completions" -H 'Content-Type: application/json' -d '{
  "model": "smollm2-135m-instruct",
  "messages": [{"role": "user", "content": "What is the capital of France?"}],
  "max_tokens": 32, "temperature": 0}'
echo

curl -sN "$BASE/v1/chat/completions" -H 'Content-Type: application/json' -d '{
  "model": "smollm2-135m-instruct",
  "messages": [{"role": "user", "content": "Name three rivers."}],
  "max_tokens": 48, "stream": true, "stream_options": {"include_usage": true}}'
