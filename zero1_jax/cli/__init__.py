"""Command-line tools: zero1-train, zero1-export."""
