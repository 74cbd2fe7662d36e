"""DLRM on Criteo-like data, trained with or without the library's pipelines (see README.md)."""
