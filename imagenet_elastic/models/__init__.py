"""The model and its weights; below train/ and tools/, above checkpoint/ and config/ (which import none of it)."""
