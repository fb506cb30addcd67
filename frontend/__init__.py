"""The OpenAI-compatible HTTP front end: its own process, a client of the coordinator.

    HTTP clients --> uvicorn + Starlette (app.py) --> Upstream (one zmq.asyncio DEALER)
                                                          |  Generate / Cancel / Status
                                                          v
                                                     coordinator (ROUTER --bind)

The process runs no model: it turns OpenAI requests into the coordinator's
messages (shared/protocol.py) and its replies back into OpenAI responses, as vLLM's
API server does for its engine core. It runs as `python -m frontend`: `coordinator --http
ADDR` starts it beside the daemon (coordinator/frontend_process.py); `fermoe serve --connect
ADDR --http ADDR` runs one alone. It imports nothing of the daemon's: only shared/.
"""
