"""Runnable examples built on jaxkv (not installed with the package; tests import them from the project root)."""
