"""Helpers the test modules share: tiny models and checkpoints in every layout, case builders, references."""
