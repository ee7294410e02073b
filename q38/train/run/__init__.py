"""A run: the trainer loop, launch, run config, metrics, evaluation, watchdog, profiling, safety, trackers."""
