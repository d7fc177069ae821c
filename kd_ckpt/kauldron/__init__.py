"""kd_ckpt's Kauldron glue: the only place that imports Kauldron.

Installed with `pip install "kd_ckpt[kauldron]"`.  `SafeCheckpointer` is also
reachable as `kd_ckpt.SafeCheckpointer` (imported on first use, so plain
Orbax users never import Kauldron).
"""

from kd_ckpt.kauldron.checkpointer import SafeCheckpointer

__all__ = ['SafeCheckpointer']
