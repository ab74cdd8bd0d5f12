"""Super-Natural-Instructions fine-tuning pieces: task reading, Tk-Instruct encoding and batching,
the official Rouge-L / exact-match metric, and distributed generation-based evaluation."""
