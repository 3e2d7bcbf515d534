"""Training: self-distillation data (generated or teacher-forced), the training loop, the base model's pretraining."""
