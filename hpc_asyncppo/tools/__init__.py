"""Tools a multi-turn rollout calls (issue 23; the rollout loop does not call them yet):
``base.py`` (what a tool is, verl's tool config), ``hermes.py`` (tool calls in the model's
text), ``runner.py`` (calls beside generation: cap, timeout, failures as observations),
``code_interpreter.py`` on ``sandbox.py`` (untrusted Python on a compute node)."""
