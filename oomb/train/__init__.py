"""The training application: config, data, model presets, the loop behind `oomb train`, `oomb eval`.

Its modules are imported where used (``oomb.train.loop.trainer.train``, ``oomb.train.config.settings.load_config``):
importing oomb.train alone builds nothing.
"""

__all__: list[str] = []
