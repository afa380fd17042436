"""Model (BERT MLM) and offline data used by the zero1_jax training scripts, benchmarks and demo."""
