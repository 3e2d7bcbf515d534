"""Training: self-distillation data, the shared training loop, and the default model's pretraining."""
