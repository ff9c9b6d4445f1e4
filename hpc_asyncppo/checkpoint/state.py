"""What a checkpoint asks of each piece of state: ``state_dict()`` and ``load_state_dict``.

Every object a checkpoint holds has one owner exposing these two methods, and the
checkpoint protocol (``protocol.py``) only collects them by name (``{name: state}``) and
writes or restores them; it imports none of their classes. The owners:

  progress     ``trainer/progress.py`` ``Progress``: the leader's counters (manifest)
  credits      ``trainer/credits.py`` ``CreditController``: groups trained (manifest)
  intake       ``trainer/intake.py`` ``Intake`` (leader.h5): its queue (``trainer/queue.py``)
               and data order (``tasks/order.py``), each a state of its own inside it,
               and the cut groups per rollout rank
  policy       ``trainer/policy.py`` ``Policy``: a trainer rank's shards, the LR schedule
               and a LoRA run's base identity (``ShardedStateful``)
  rng          ``RngState`` below: one process's RNGs (each trainer and rollout rank)
  cut_groups   ``rollout/cut_groups.py`` ``CutGroups``: a rollout rank's cut groups with
               their tools' state

A ``state_dict()`` is a tree of what ``store.py`` writes: dicts, lists, tensors, numpy
arrays, numbers, strings. Its top-level keys go at the root of the file that holds the
state (a part, or the manifest), beside those of the other states in that file; keys
never collide (checked on writing). ``load_state_dict`` gets a mapping of that file's
root and takes its own keys: read lazily, key by key, so a state reads no more of a part
than it wrote.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

from hpc_asyncppo.checkpoint.store import StateReader, rng_state, set_rng_state


class Stateful(Protocol):
    """A piece of state a checkpoint holds, read back whole."""

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: Mapping[str, Any]) -> None: ...


class ShardedStateful(Protocol):
    """A piece of state split over the trainer ranks (the policy's shards): written as this
    rank's rows, read back through a ``StateReader`` that gives any rows of a whole tensor
    from however many old parts hold them, one tensor at a time."""

    def state_dict(self) -> dict: ...

    def load_state_dict(self, reader: StateReader) -> None: ...


class RngState:
    """This process's RNGs (Python, NumPy's global one, torch CPU, CUDA if present) under
    the key ``rng``: a few KiB per rank. Loading sets them at once."""

    def state_dict(self) -> dict:
        return {"rng": rng_state()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        set_rng_state(state["rng"])
