"""Training: ``q38.train.train_step(params, batch, mesh)`` (``params``: the whole ``TrainState``), ``init_state`` and
``TrainState``; the run loop is ``q38.train.run.trainer.train``. Imported on first use, so ``import q38.train.core.step_config``
does not pull in the step."""

_EXPORTS = {"train_step": "q38.train.core.step", "init_state": "q38.train.core.state", "TrainState": "q38.train.core.state"}
__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        import importlib

        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'q38.train' has no attribute {name!r}")
