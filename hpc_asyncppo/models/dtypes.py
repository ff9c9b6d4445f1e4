"""The names ``model.dtype`` takes, as torch dtypes: one table for both roles and the export."""

from __future__ import annotations

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
