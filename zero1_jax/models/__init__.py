"""Models the ``zero1-train`` CLI trains (Flax linen BERT-MLM sizes)."""
