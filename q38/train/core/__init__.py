"""The step's math: the batch-to-loss objective, losses, AdamW, the train state, recompute, the step config."""
