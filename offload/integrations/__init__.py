"""Callbacks that run offload inside the trainers people use.

Each submodule imports its trainer package only when it is imported itself: ``import offload``
imports neither transformers nor lightning.

- :mod:`offload.integrations.hf`: ``OffloadCallback`` for ``transformers.Trainer``.
- :mod:`offload.integrations.lightning`: ``OffloadCallback`` for ``lightning.pytorch.Trainer``.
"""
