"""What exists only to be torchrec-compatible."""
