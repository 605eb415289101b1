"""What a run reads: data sources (files, datasets, the built-in tasks), rows and chat samples, packing into
sequences, document windows, and the inputs of a run built from them (inputs)."""

__all__: list[str] = []
