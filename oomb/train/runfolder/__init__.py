"""A run's folder: its files reached without following links (runfiles), the folder's life (rundir),
checkpoints and the export (checkpoint), and sharded checkpoints read safely (safe_dcp)."""

__all__: list[str] = []
