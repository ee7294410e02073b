"""Checkpoint I/O: q38 checkpoints, Hugging Face import/export, PEFT, the checks of untrusted checkpoint files."""
