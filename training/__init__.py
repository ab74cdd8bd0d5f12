"""T5 v1.1 pre-training and fine-tuning on DeepSpeed."""
