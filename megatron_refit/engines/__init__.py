"""Generation-side receivers: map received HF-named pieces into an engine's own storage."""
