"""The stage modules a rank runs: reads a model and a Partition, returns one ``nn.Module`` per stage.

:mod:`.sequential` cuts a model whose children run in order; :mod:`.traced` splits any model with ``torch.export``
(as torch's ``pipeline()`` front end does) when its children do not chain.
"""

from __future__ import annotations

__all__: list[str] = []
