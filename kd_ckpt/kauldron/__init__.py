"""kd_ckpt's Kauldron glue: the only place that imports Kauldron.

Installed with `pip install "kd_ckpt[kauldron]"`.  `SafeCheckpointer` (the
checkpointer) and `InitWithinBudget` (pretrained weights loaded within a
budget) are also reachable as `kd_ckpt.SafeCheckpointer` and
`kd_ckpt.InitWithinBudget` (imported on first use, so plain Orbax users never
import Kauldron).
"""

from kd_ckpt.kauldron.checkpointer import SafeCheckpointer
from kd_ckpt.kauldron.init_transform import InitWithinBudget

__all__ = ['InitWithinBudget', 'SafeCheckpointer']
