"""Tools a multi-turn rollout can call (the sandboxed code interpreter: ``sandbox.py``)."""
