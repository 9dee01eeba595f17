"""Against `make serve`: plain, streamed and structured (JSON schema) chat completions with the
official `openai` package."""

import json
import os

from openai import OpenAI

client = OpenAI(base_url=os.environ.get("LMSTACK_URL", "http://127.0.0.1:8000") + "/v1", api_key="unused")
MODEL = "smollm2-135m-instruct"

reply = client.chat.completions.create(
    model=MODEL, messages=[{"role": "user", "content": "What is the capital of France?"}], temperature=0
)
print(reply.choices[0].message.content, reply.usage)

stream = client.chat.completions.create(
    model=MODEL,
    messages=[{"role": "user", "content": "Name three rivers."}],
    max_tokens=48,
    stream=True,
    stream_options={"include_usage": True},
)
for chunk in stream:
    print(chunk.choices[0].delta.content or "" if chunk.choices else f"\n{chunk.usage}", end="", flush=True)
print()

schema = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 40},
        "population": {"type": "integer", "minimum": 0},
    },
    "required": ["city", "population"],
    "additionalProperties": False,
}
reply = client.chat.completions.create(
    model=MODEL,
    messages=[{"role": "user", "content": "Give me a large city and its population as JSON."}],
    response_format={"type": "json_schema", "json_schema": {"name": "city", "schema": schema}},
    max_tokens=80,
)
print(json.loads(reply.choices[0].message.content))
