"""Talk to `nanoserve serve` with the official openai client (pip install openai).

tests/test_serve_docs.py runs this file against a live server.
"""

import os

from openai import OpenAI

url = os.environ.get("NANOSERVE_URL", "http://127.0.0.1:8000")
model = os.environ.get("NANOSERVE_MODEL", "smollm2")
client = OpenAI(base_url=f"{url}/v1", api_key=os.environ.get("NANOSERVE_API_KEY", "none"))

# A chat completion, whole.
reply = client.chat.completions.create(
    model=model, messages=[{"role": "user", "content": "Name three planets."}], max_tokens=24, temperature=0)
print(reply.id, reply.choices[0].finish_reason, reply.usage.total_tokens)
print(reply.choices[0].message.content)

# Streamed: text arrives as the engine produces it.
stream = client.chat.completions.create(
    model=model, messages=[{"role": "user", "content": "Count to five."}], max_tokens=24, stream=True)
for chunk in stream:
    print(chunk.choices[0].delta.content or "", end="", flush=True)
print()

# Two samples of one prompt (n=2: the prompt is computed once, then forked), reproducible with a seed.
samples = client.completions.create(model=model, prompt="A haiku about caches:", max_tokens=16, n=2,
                                    temperature=0.8, seed=1)
for choice in samples.choices:
    print(choice.index, repr(choice.text))
