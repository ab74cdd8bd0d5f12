"""Generic text-to-text fine-tuning pieces: reading a dataset's splits from local files or a saved
Hugging Face dataset, building inputs and targets from templates, the metrics by name, and
distributed generation-based evaluation (which reuses the SNI path's generation and gathering)."""
