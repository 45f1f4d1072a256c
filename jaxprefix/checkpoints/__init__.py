"""Checkpoint formats: HF directories (hf.py), GGUF (gguf.py), training state (train_state.py)."""
