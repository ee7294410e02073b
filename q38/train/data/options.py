"""The data pipeline's option values and defaults that the command line shows (``q38 prepare-data --help``): kept
apart from the modules that use them, which import torch, so ``q38 --help`` answers without it."""

TRAIN_ON = ("assistant", "all", "last_assistant")  # which tokens of a chat record are targets (data.train_on)
CHUNK_BYTES = 64 << 20  # input bytes per prepared shard (prepare-data --chunk-mb)
