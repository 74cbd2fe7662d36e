"""torchrec's example trainers, vendored as test fixtures (README.md: where from, what changed)."""
