from __future__ import annotations
from dataclasses import dataclass

@dataclass
class Cfg:
    n_layer: int
    inner: Undefined  # noqa: F821

class Net:
    def __init__(self, config: Cfg, layers: int = 2):
        self.config = config
