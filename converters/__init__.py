"""Checkpoint converters: PyTorch / safetensors Wan 2.1 checkpoints -> jaxkv params."""
