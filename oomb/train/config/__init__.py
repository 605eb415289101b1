"""What a run is told: the config and its keys (settings, keys, yaml_text), inputs read within bounds
(bounded), the device it trains on (device), built-in model presets and the demo, RoPE settings, the model
reference (hub), and the checks made before any work (checks)."""

__all__: list[str] = []
