"""Hugging Face transformers models as an engine: whole tensors, gen TP 1 (the CPU reference)."""
