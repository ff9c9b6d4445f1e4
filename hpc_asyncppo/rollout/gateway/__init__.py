"""Bring your own agent: a gateway on each rollout rank that speaks the APIs harnesses do.

``requests.py``           what each request field does (one table), and the ``Call`` every
                          door hands the sessions
``openai_chat.py``        the Chat Completions and Completions door: answers in OpenAI's shape
``openai_responses.py``   the Responses door (the OpenAI Agents SDK's default)
``anthropic_messages.py`` the Messages door (the ``anthropic`` SDK)
``chat.py``               a session's conversation and its exact tokens (what is tokenized,
                          what is kept as sampled)
``sessions.py``           the rank's side: sessions as the engine's responses, calls entering
                          the engine between two steps, rewards, the groups sent
``agents.py``             ``data.agent``: the user's function run per session, with a bound client
``server.py``             the HTTP endpoints (FastAPI on uvicorn, in a thread of the rank), the
                          token, errors in each API's shape
``addresses.py``          the address files and the token in RUN_DIR/gateway/
"""
