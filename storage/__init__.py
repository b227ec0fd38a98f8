"""Crash-safe file writing shared by every layer that saves files (the HF model export in model/, the
training checkpoints in trainer/); imports no other package of the project."""
