"""Data: sources and formats, tokenizing and chat templates, prepared shards, packing and loading."""
