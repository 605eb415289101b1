"""The training application: config, data, model presets, the loop behind `oomb train`."""
