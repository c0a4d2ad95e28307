"""`ftctl sim`: a deterministic tiny torch transformer behind an OpenAI-compatible server.

In the spirit of Dynamo's mocker engine, but running a real (tiny) model so
that KV caches, token ids, logprobs and faults are real:

- `config`     engine configs (`ftctl-sim-tiny` and YAML files)
- `tokenizer`  byte-level BPE (default; `tokenizer.json`) or exact byte tokenizer
- `model`      decoder-only transformer (RoPE, RMSNorm, GQA), weights from a seed
- `cache`      paged KV cache: fixed block pool, per-request block tables
- `sampling`   greedy / temperature, top-k, top-p keyed by (seed, position)
- `scheduler`  continuous batching: one batched forward per step
- `state`      a server's settings, engine, driver and faults
- `validation` OpenAI request checks (vLLM's strict fields, un-encodable text)
- `stream`     a generation's answer: token steps, SSE chunks, whole bodies
- `routes`     OpenAI API, health, metrics, sleep, KV, faults on `httpapp.Router`
- `server`     serve the routes on `httpserver` until a signal
- `launcher`   start one worker or a whole local cluster as processes
- `errors`     every exception of the engine and its server

This package's `__init__` imports nothing: torch loads only where it is used.
"""

__all__: list[str] = []
