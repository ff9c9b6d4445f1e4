"""Tools a multi-turn rollout calls between its turns (``rollout/turns.py`` runs them):
``base.py`` (what a tool is, verl's tool config), ``hermes.py`` (tool calls in the model's
text), ``runner.py`` (calls beside generation: cap, timeout, failures as observations),
``code_interpreter.py`` on ``sandbox.py`` (untrusted Python on a compute node)."""
