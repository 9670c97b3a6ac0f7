"""Talk to `hf-paged serve` with the openai client: a completion, a streamed chat, and the server's metrics.

    pip install -e ".[serve]" openai   # in the hf_paged clone
    hf-paged serve &            # SmolLM2-135M-Instruct (fetched once on first use); --model DIR for another
    python examples/serve_client.py
"""

import httpx
from openai import OpenAI

BASE_URL = "http://127.0.0.1:8000"
client = OpenAI(base_url=f"{BASE_URL}/v1", api_key="unused")
model = client.models.list().data[0].id

completion = client.completions.create(model=model, prompt="The three primary colours are", max_tokens=16,
                                       temperature=0)
print("completion:", repr(completion.choices[0].text), completion.usage)

stream = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "What is the capital of "
                                                                                     "France?"}],
                                        max_tokens=32, temperature=0.8, seed=0, stream=True)
print("chat: ", end="")
for chunk in stream:
    print(chunk.choices[0].delta.content or "", end="", flush=True)
print()

print("\n".join(line for line in httpx.get(f"{BASE_URL}/metrics").text.splitlines()
                if line.startswith(("hf_paged_generation_tokens_total", "hf_paged_kv_blocks_used"))))
