"""Weights and text in: checkpoints, GGUF files and hub ids to one loader, tokenizers, chat templates."""
