"""Serving: an OpenAI-compatible HTTP server with continuous batching on N tensor-parallel ranks.

protocol   request schemas and response bodies (the OpenAI wire format)
text       chat templates, detokenised streams with stop strings
scheduler  continuous batching on rank 0: queue, KV-cache slots, sampling
step       the step message rank 0 broadcasts (int64 header + payload)
worker     each rank's loop: rank 0 leads (and runs HTTP), the others follow
app, http  the FastAPI routes; body-size cap and uvicorn in a thread
metrics    Prometheus text format

Only worker, app and http need the serve extra (fastapi, uvicorn); importing this package
does not.
"""

from shardwise.serve.scheduler import EngineDown, Output, QueueFull, Scheduler, Sequence
from shardwise.serve.step import Kind, recv_step, send_step

__all__ = [
    "Kind",
    "send_step",
    "recv_step",
    "Scheduler",
    "Sequence",
    "Output",
    "QueueFull",
    "EngineDown",
]
