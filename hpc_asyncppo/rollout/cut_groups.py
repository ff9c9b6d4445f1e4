"""A rollout rank's cut groups in a checkpoint: the groups it was generating when the
checkpoint came, with their tokens so far, continued after a resume.

``CutGroups`` is the ``cut_groups`` state of a rollout part (``checkpoint/state.py``). Each
group keeps its data epoch, its position in the rank's prompts, the version that started
it, and the group so far (``PartialGroup``): prompt tokens, and per response its tokens,
log-probs and per-token versions so far, whether it finished, with multi-turn the loss
mask (where the observations lie) and what its tools keep of its trajectories (JSON, as
bytes), and with an agent's session in several sequences each row's session and prompt.
Memory: for each group in flight (at most ``rollout.prompts_per_generate``),
``n x width`` token ids, log-probs and versions (4 bytes each) and a 1-byte loss mask.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from hpc_asyncppo.rollout.generation import Generation, PartialGroup
from hpc_asyncppo.rollout.turns import decode_state, encode_state

# (data epoch, position in the rank's prompts, weights version at its start, the group so far)
CutGroup = tuple[int, int, int, PartialGroup]


class CutGroups:
    def __init__(self, groups: list[CutGroup] | None = None):
        self.groups: list[CutGroup] = list(groups or [])

    def state_dict(self) -> dict:
        """Under ``partial``: one subtree per group (arrays and numbers only)."""
        return {"partial": [_group_tree(*group) for group in self.groups]}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """The groups of one rollout part (none if it has none), in place of those held."""
        self.groups = [_group_of(tree) for tree in state.get("partial") or []]


def _group_tree(epoch: int, index: int, version_start: int, partial: PartialGroup) -> dict:
    g = partial.sofar
    return {
        "epoch": epoch,
        "index": index,
        "version_start": version_start,
        "prompt": np.asarray(partial.prompt, dtype=np.int32),
        "response_ids": g.response_ids,
        "response_lengths": g.response_lengths,
        "log_probs": g.log_probs,
        "versions": g.versions,
        "finished": partial.finished,
        # multi-turn: where the observations lie (absent for single-turn groups), and what
        # the tools keep of its trajectories (JSON, as bytes)
        **({"loss_mask": g.loss_mask} if g.loss_mask is not None else {}),
        # agents' sessions in several sequences: each row's session and prompt
        **(
            {"row_sessions": g.row_sessions, "row_prompts": g.row_prompts}
            if g.row_sessions is not None
            else {}
        ),
        **(
            {"tools": np.frombuffer(encode_state(partial.tools), dtype=np.uint8)}
            if partial.tools is not None
            else {}
        ),
    }


def _group_of(tree: dict) -> CutGroup:
    sofar = Generation(
        tree["response_ids"],
        tree["response_lengths"],
        tree["log_probs"],
        tree["versions"],
        tree.get("loss_mask"),
        tree.get("row_sessions"),
        tree.get("row_prompts"),
    )
    tools = decode_state(tree["tools"].tobytes()) if "tools" in tree else None
    partial = PartialGroup(tree["prompt"].tolist(), sofar, tree["finished"].astype(bool), tools)
    return int(tree["epoch"]), int(tree["index"]), int(tree["version_start"]), partial
