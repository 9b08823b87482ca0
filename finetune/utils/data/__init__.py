"""Data the engine trains on: the SeriesPanel, the prepared memory-mapped store, windows and epoch order."""
