"""Runnable models: the reference Transformer and Hugging Face models built from config."""
