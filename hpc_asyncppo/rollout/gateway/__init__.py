"""Bring your own agent: an OpenAI-compatible gateway on each rollout rank.

``chat.py``      a session's conversation and its exact tokens (what is tokenized, what
                 is kept as sampled), OpenAI's messages in and out
``sessions.py``  the rank's side: sessions as the engine's responses, calls entering the
                 engine between two steps, rewards, the groups sent
``agents.py``    ``data.agent``: the user's function run per session, with a bound client
``server.py``    the HTTP endpoints (FastAPI on uvicorn, in a thread of the rank), the
                 bearer token and the address files in RUN_DIR/gateway/
"""
