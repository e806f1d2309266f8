"""llmtrain: PyTorch-native pretraining of large language models from one YAML file.

The package is layered in one direction: ``config`` (typed dataclasses, YAML) -> ``data`` (tokenize, pack,
Megatron ``.bin/.idx`` shards, loaders) -> ``models`` (single-device model code, named flavors) ->
``distributed`` (degrees, meshes, parallel plans applied from outside the model) -> ``train`` (the loop and
the components it calls) -> ``commands`` (one module per command: its flags, then a call into the layers
below) -> ``cli`` (one entry point).
"""

__version__ = "0.1.0"
