"""stalwart: fault-tolerant, elastic data-parallel training for PyTorch.

Workers die and join while training goes on: the global batch stays the size
asked for, every sample of an epoch is trained on exactly once, and sharded
optimizer state survives the loss of a node.
"""

__version__ = "0.1.0"
